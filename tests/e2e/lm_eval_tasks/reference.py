"""What lm-eval's answers should be, computed with plain transformers on the served model (float32,
no actq, no lm-eval model class): a multiple-choice continuation's log-likelihood and is_greedy,
and a greedy generation cut at the task's stop strings.

lm-eval 0.4.13 (`TemplateLM._encode_pair`, causal models) scores a request (context, continuation)
so: trailing spaces of the context move to the continuation; the whole text and the context are
each tokenized without special tokens, and the continuation is the whole text's tokens past the
context's token count. The request's tokens are the whole text's; the answer is the sum of the
log-probabilities of the tokens past the context's count, each given all tokens before it, and
is_greedy says each of them is the likeliest token at its place. With `tokenized_requests=False`
lm-eval sends those tokens decoded back to text and still slices the server's answer at the
context's count, so the same reference holds when the server's tokens of that text are the same."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


def encode_pair(tokenizer: Any, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """(context tokens, continuation tokens) exactly as lm-eval 0.4.13 cuts them (module docstring)."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tokenizer(context + continuation, add_special_tokens=False).input_ids
    cut = len(tokenizer(context, add_special_tokens=False).input_ids)
    return whole[:cut], whole[cut:]


@dataclass
class Reference:
    """The served model loaded here in float32, with memos: several lm-eval runs score the same requests."""

    model: Any
    tokenizer: Any
    _scores: dict[tuple[str, str], tuple[float, bool]] = field(default_factory=dict)
    _generations: dict[tuple[str, ...], str] = field(default_factory=dict)

    @classmethod
    def load(cls, path: Path) -> Reference:
        model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=torch.float32)
        return cls(model.eval(), AutoTokenizer.from_pretrained(path, local_files_only=True))

    def loglikelihood(self, context: str, continuation: str) -> tuple[float, bool]:
        """(sum of the continuation's token log-probabilities, is every one of them the argmax)."""
        key = (context, continuation)
        if key not in self._scores:
            context_ids, continuation_ids = encode_pair(self.tokenizer, context, continuation)
            ids = context_ids + continuation_ids
            with torch.inference_mode():
                logits = self.model(input_ids=torch.tensor([ids])).logits[0].float()
            # row i scores the token after position i: the continuation's tokens are scored by the rows before them
            rows = logits[len(context_ids) - 1 : len(ids) - 1]
            targets = torch.tensor(continuation_ids)
            logprobs = torch.log_softmax(rows, dim=-1).gather(1, targets[:, None])[:, 0]
            self._scores[key] = (float(logprobs.sum()), bool((rows.argmax(dim=-1) == targets).all()))
        return self._scores[key]

    def generate(self, ids: list[int], max_new_tokens: int, stop: list[str]) -> str:
        """Greedy `generate` from the prompt tokens `ids`, decoded and cut before the first stop string."""
        key = (repr(ids), str(max_new_tokens), *stop)
        if key not in self._generations:
            with torch.inference_mode():
                out = self.model.generate(
                    input_ids=torch.tensor([ids]),
                    attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                    max_new_tokens=max_new_tokens,
                    do_sample=False,
                    pad_token_id=self.tokenizer.eos_token_id,
                )
            text = self.tokenizer.decode(out[0, len(ids) :], skip_special_tokens=True)
            cuts = [text.index(s) for s in stop if s and s in text]
            self._generations[key] = text[: min(cuts)] if cuts else text
        return self._generations[key]

    def rolling_loglikelihood(self, text: str, prefix_id: int) -> float:
        """A document's log-likelihood as a perplexity task scores it (lm-eval's
        loglikelihood_rolling with one window: the document shorter than the model's length): the
        sum of the log-probabilities of its tokens (tokenized without special tokens), each given
        the prefix token and every token before it."""
        ids = [prefix_id, *self.tokenizer(text, add_special_tokens=False).input_ids]
        with torch.inference_mode():
            logits = self.model(input_ids=torch.tensor([ids])).logits[0].float()
        logprobs = torch.log_softmax(logits[:-1], dim=-1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
        return float(logprobs.sum())

    def block_output(self, ids: list[int], layer: int) -> torch.Tensor:
        """Decoder block `layer`'s output at every position of `ids`, `[len(ids), hidden]` float32
        (hidden_states[0] is the embeddings, so block i's output is hidden_states[i + 1])."""
        with torch.inference_mode():
            out = self.model(input_ids=torch.tensor([ids]), output_hidden_states=True)
        return out.hidden_states[layer + 1][0].float()

    def text_ids(self, text: str) -> list[int]:
        """A completion prompt's tokens: the text tokenized as it is (SmolLM2's tokenizer adds no BOS)."""
        return list(self.tokenizer(text).input_ids)

    def chat_ids(self, messages: list[dict[str, str]]) -> list[int]:
        """A chat's tokens through the model's chat template, ready for the assistant's reply."""
        encoded = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)
        return list(encoded["input_ids"])
