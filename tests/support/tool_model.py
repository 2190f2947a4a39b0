"""A tiny Llama that calls the calculator for real, so that the with-tools loop can be tested end
to end with no mocked output: trained at test time (about 45 s on one CPU core, then cached) on
GSM8K-style word problems.

`build_tool_model(folder, tokenizer_dir)` makes a 2-layer Llama (hidden 64) with SmolLM2's
tokenizer and the Hermes 2 Pro tool chat template (tests/data/chat_templates, Apache-2.0) as its
chat template, trains it (AdamW, float32, CPU, seeded, 800 steps of 16 conversations, the first
60% without the long tools prompt: see `_train`; only the embedding rows of the tokens the
conversations use are trained, see `_train_compact`) on synthetic two-number problems (`problems`),
and saves model and tokenizer in `folder`. Each training conversation is rendered
by the template itself, with the calculator's `TOOL`:

    user       Tom has 12 apples and buys 7 more. How many apples does he have now?
    assistant  (a tool call, as the template renders one:)
               <tool_call>
               { "arguments": {"expression": "12 + 7"}, "name": "calculator"}
               </tool_call>
    tool       (name "calculator", content: calculate("12 + 7").text, "19")
    assistant  The answer is 19.

and the loss is on the assistant turns only (their text and `<|im_end|>`). So the model learns
what the template shows: the call's format, the expression's numbers copied from the question in
order with the operator its wording implies, and the final answer copied from the tool's result
("The answer is N.", which the GSM8K scoring's strict match reads). It does not learn arithmetic.
Past assistant calls are rendered with their `arguments` as a JSON object (the template applies
`tojson` to them): a caller that holds OpenAI's JSON-string arguments must decode them first.

`cached_tool_model(cache_dir, tokenizer_dir)` keeps one build per key (this file's source, the
calculator's `TOOL`, the template, the tokenizer's files, the seed, torch and transformers
versions) under `cache_dir`, built under a file lock and moved into place whole, so reruns skip
the training.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from filelock import FileLock
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from shared.calculator import TOOL, TOOL_NAME, calculate

TEMPLATE_PATH = Path(__file__).parents[1] / "data" / "chat_templates" / "tool_chat_template_hermes_2_pro.jinja"
POOL = 2000  # distinct training conversations (problems(POOL, seed)), sampled into batches
TOOL_MODEL_CONTEXT = 1024  # a rendered problem is about 460 tokens, most of them the tools prompt

_NAMES = ["Tom", "Anna", "Ben", "Maria", "Liam", "Sofia", "Omar", "Chen", "Priya", "Jack", "Emma", "Noah"]
_PRONOUNS = {"Anna": "she", "Maria": "she", "Sofia": "she", "Priya": "she", "Emma": "she"}
_ITEMS = ["apple", "book", "marble", "cookie", "pencil", "sticker", "card", "shell", "stamp", "orange"]

# (operator, question): the expression is always "{a} {op} {b}", the numbers in question order.
_TEMPLATES = [
    ("+", "{name} has {a} {item}s and buys {b} more. How many {item}s does {pron} have now?"),
    ("+", "{name} picked {a} {item}s on Monday and {b} {item}s on Tuesday. How many {item}s did {pron} pick in total?"),
    ("+", "A shop sold {a} {item}s in the morning and {b} {item}s in the afternoon. How many {item}s did it sell?"),
    ("-", "{name} has {a} {item}s and gives {b} of them to a friend. How many {item}s does {pron} have left?"),
    ("-", "{name} had {a} {item}s and lost {b} of them. How many {item}s are left?"),
    ("-", "A box holds {a} {item}s. {name} takes out {b}. How many {item}s are still in the box?"),
    ("*", "{name} buys {a} bags with {b} {item}s in each bag. How many {item}s does {pron} buy?"),
    ("*", "There are {a} rows of {item}s with {b} {item}s in each row. How many {item}s are there?"),
    ("*", "{name} reads {a} pages a day for {b} days. How many pages does {pron} read?"),
]


@dataclass(frozen=True)
class Problem:
    question: str
    expression: str  # what the calculator call should carry
    answer: str  # the calculator's result for it, the expected final answer

    def messages(self) -> list[dict]:
        """The whole conversation: question, the call, the tool's result, the final answer."""
        return [
            {"role": "user", "content": self.question},
            {"role": "assistant", "tool_calls": [call(self.expression)]},
            {"role": "tool", "name": TOOL_NAME, "content": self.answer},
            {"role": "assistant", "content": final_answer(self.answer)},
        ]


def call(expression: str) -> dict:
    """A calculator call as a past assistant turn carries it (arguments as an object, for the template)."""
    return {"type": "function", "function": {"name": TOOL_NAME, "arguments": {"expression": expression}}}


def final_answer(answer: str) -> str:
    return f"The answer is {answer}."


def problems(n: int, seed: int) -> list[Problem]:
    """`n` random two-number problems (+, - with a positive result, *), reproducible from `seed`."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        op, text = rng.choice(_TEMPLATES)
        if op == "*":
            a, b = rng.randint(2, 20), rng.randint(2, 20)
        else:
            a, b = rng.randint(2, 99), rng.randint(2, 99)
            if op == "-" and a <= b:
                a, b = b + rng.randint(1, 20), a
        name = rng.choice(_NAMES)
        question = text.format(name=name, pron=_PRONOUNS.get(name, "he"), item=rng.choice(_ITEMS), a=a, b=b)
        expression = f"{a} {op} {b}"
        out.append(Problem(question, expression, calculate(expression).text))
    return out


def chat_template() -> str:
    return TEMPLATE_PATH.read_text()


def _encode(tokenizer, template: str, problem: Problem) -> tuple[list[int], list[bool]]:
    """Token ids of the rendered conversation, and which of them the loss predicts (assistant turns)."""
    messages = problem.messages()

    def render(msgs: list[dict], prompt: bool) -> str:
        return tokenizer.apply_chat_template(
            msgs, tools=[TOOL], chat_template=template, tokenize=False, add_generation_prompt=prompt
        )

    full = render(messages, False)
    spans = []
    for turn in (1, 3):  # the two assistant turns: from after their prompt to their <|im_end|>, included
        prefix = render(messages[:turn], True)
        assert full.startswith(prefix), "the template must render a conversation's prefix unchanged"
        end = full.index(tokenizer.eos_token, len(prefix)) + len(tokenizer.eos_token)
        spans.append((len(prefix), end))
    encoded = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    targets = [any(lo <= start < hi for lo, hi in spans) for start, _ in encoded["offset_mapping"]]
    return encoded["input_ids"], targets


def build_tool_model(
    folder: Path,
    tokenizer_dir: Path,
    seed: int = 0,
    *,
    steps: int = 800,
    batch_size: int = 16,
    lr: float = 5e-3,
    short_fraction: float = 0.6,
    heads: int = 4,
    threads: int = 1,  # a second thread saves a third on a quiet machine and costs double on a busy one
) -> Path:
    """Train the tool-calling tiny Llama and save it (model, tokenizer, template) in `folder`."""
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    template = chat_template()
    tokenizer.chat_template = template
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        vocab_size=len(tokenizer),
        max_position_embeddings=TOOL_MODEL_CONTEXT,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=pad,
    )
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config).float()
        pool = [_encode(tokenizer, template, p) for p in problems(POOL, seed)]
        _train_compact(
            model, pool, pad, steps=steps, batch_size=batch_size, lr=lr, seed=seed, short_fraction=short_fraction
        )
    finally:
        torch.set_num_threads(previous_threads)
    model.generation_config.pad_token_id = pad
    model.generation_config.do_sample = False
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def _train_compact(model, pool, pad: int, **training) -> list[float]:
    """Train `model` on the tokens the conversations use only (a few hundred of the 49152): a
    copy of it whose embedding (tied to its output layer) holds just their rows is trained, and
    its weights written back. The full vocabulary's embedding would cost most of a step (its
    dense gradient and AdamW's update of 6.3M weights), and the output layer's softmax over it
    more. The other tokens' embeddings keep their small random initial values, so their logits
    stay far below the trained ones (generation, over the whole vocabulary, shows it)."""
    vocabulary = torch.tensor(sorted({token for ids, _ in pool for token in ids}))
    index = torch.full((model.config.vocab_size,), -1, dtype=torch.long)
    index[vocabulary] = torch.arange(len(vocabulary))
    # The pad token (the embedding's padding_idx: kept at zero, never trained) and the special ids
    # are renumbered with the rest.
    special = {k: int(index[model.config.to_dict()[k]]) for k in ("pad_token_id", "bos_token_id", "eos_token_id")}
    config = LlamaConfig(**{**model.config.to_dict(), **special, "vocab_size": len(vocabulary)})
    compact = LlamaForCausalLM(config).float()
    state = {k: v for k, v in model.state_dict().items() if not k.endswith(("embed_tokens.weight", "lm_head.weight"))}
    state["model.embed_tokens.weight"] = model.model.embed_tokens.weight.detach()[vocabulary].clone()
    compact.load_state_dict(state, strict=False)
    compact.tie_weights()
    renumbered = [(index[torch.tensor(ids)].tolist(), targets) for ids, targets in pool]
    losses = _train(compact, renumbered, int(index[pad]), **training)
    with torch.no_grad():
        trained = compact.state_dict()
        model.load_state_dict(
            {k: v for k, v in trained.items() if not k.endswith(("embed_tokens.weight", "lm_head.weight"))},
            strict=False,
        )
        model.model.embed_tokens.weight[vocabulary] = trained["model.embed_tokens.weight"]
    model.eval()
    return losses


def _train(
    model, pool, pad: int, *, steps: int, batch_size: int, lr: float, seed: int, short_fraction: float = 0.6
) -> list[float]:
    """AdamW on random batches of `pool`; the losses, step by step. Every conversation starts with
    the same tokens (the tools prompt, most of each), so a step runs them once, as a shared KV
    cache the rows continue from (gradients flow through it), which makes a step about 5x cheaper."""
    rng = random.Random(seed)
    shared = _common_prefix([ids for ids, _ in pool])
    prefix = torch.tensor([pool[0][0][:shared]])
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0, betas=(0.9, 0.98))
    warmup = max(1, steps // 10)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warmup) * max(0.05, 1 - s / steps)
    )
    losses = []
    model.train()
    for step in range(steps):
        # A curriculum: the first part of the training leaves the tools prompt out, so that the
        # question is most of what attention sees and copying its numbers is found quickly (RoPE
        # positions are relative: the question and the answer are as far apart either way); the
        # rest adds it back, so that the model learns to look past it.
        short = step < steps * short_fraction
        batch = rng.sample(pool, batch_size)
        width = max(len(ids) for ids, _ in batch) - shared
        ids = torch.full((batch_size, width), pad, dtype=torch.long)
        mask = torch.zeros((batch_size, shared + width), dtype=torch.long)
        mask[:, :shared] = 1
        target = torch.zeros((batch_size, width), dtype=torch.bool)
        for row, (tokens, targets) in enumerate(batch):
            n = len(tokens) - shared
            ids[row, :n] = torch.tensor(tokens[shared:])
            mask[row, shared : shared + n] = 1
            target[row, :n] = torch.tensor(targets[shared:])
        if short:
            hidden = model.model(input_ids=ids, attention_mask=mask[:, shared:]).last_hidden_state
        else:
            cache = model.model(input_ids=prefix, use_cache=True).past_key_values
            cache.batch_repeat_interleave(batch_size)
            hidden = model.model(input_ids=ids, attention_mask=mask, past_key_values=cache).last_hidden_state
        predicting = target[:, 1:]  # position t predicts token t + 1: logits only where the loss is
        logits = model.lm_head(hidden[:, :-1][predicting])
        loss = torch.nn.functional.cross_entropy(logits, ids[:, 1:][predicting])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        losses.append(loss.item())
    model.eval()
    return losses


def _common_prefix(sequences: list[list[int]]) -> int:
    """How many leading tokens all sequences share, less one (every row keeps a token of its own)."""
    first = sequences[0]
    n = min(len(s) for s in sequences) - 1
    for seq in sequences[1:]:
        n = next((i for i in range(n) if seq[i] != first[i]), n)
    return n


def cache_key(tokenizer_dir: Path, seed: int = 0) -> str:
    digest = hashlib.sha256()
    tool = json.dumps(TOOL, sort_keys=True).encode()  # rendered into every prompt: a new description is a new model
    for part in (Path(__file__).read_bytes(), TEMPLATE_PATH.read_bytes(), tool):
        digest.update(hashlib.sha256(part).digest())
    for name in sorted(os.listdir(tokenizer_dir)):
        if name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
            digest.update(name.encode() + hashlib.sha256((tokenizer_dir / name).read_bytes()).digest())
    digest.update(f"{seed} {torch.__version__} {transformers.__version__}".encode())
    return digest.hexdigest()[:16]


def cached_tool_model(cache_dir: Path, tokenizer_dir: Path, seed: int = 0) -> Path:
    """The tool model for these inputs from `cache_dir`, built there first if missing (once, under a lock)."""
    target = cache_dir / f"tool-model-{cache_key(tokenizer_dir, seed)}"
    if (target / "config.json").exists():
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    with FileLock(str(cache_dir / f"{target.name}.lock")):
        if (target / "config.json").exists():
            return target
        staging = Path(tempfile.mkdtemp(dir=cache_dir, prefix=f".{target.name}-"))
        try:
            build_tool_model(staging, tokenizer_dir, seed)
            os.replace(staging, target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return target
