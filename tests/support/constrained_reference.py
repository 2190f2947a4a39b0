"""An independent reference for constrained decoding: plain `transformers` greedy `generate` on the
HF model, with a logits processor written here that asks llguidance directly which tokens the
grammar allows next.

What it shares with actq: the grammar TEXT (shared.grammars.grammar_for, llguidance's JSON grammar
with actq's separators), since which JSON spelling a schema compiles to is a choice, not a
result. What it does not share: everything that decides tokens from it. worker/rules/constrained.py
fills a packed bitmask per batch row (llguidance.torch, many rows in parallel, unpacked on the
logits' device) inside actq's own batched decoding loop; here one matcher per sequence is fed
the tokens `generate` picked, its mask is read one byte per token (`compute_logit_bias`), and
`transformers` does the decoding, one conversation at a time, its prompt rendered by
`apply_chat_template`. A row mixed up with another in actq's batch, a mask applied to the wrong
row or a token not fed to the matcher shows as a different text.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, cast

import llguidance
import llguidance.hf
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, BatchEncoding, LogitsProcessor, LogitsProcessorList

from shared.grammars import grammar_for
from shared.schemas import JobRequest


class GrammarMask(LogitsProcessor):
    """Sets every token the grammar forbids to -inf, for one sequence (batch of one)."""

    def __init__(self, matcher: llguidance.LLMatcher, prompt_length: int) -> None:
        self.matcher, self.prompt_length = matcher, prompt_length
        self.fed = 0  # generated tokens already given to the matcher

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        assert input_ids.shape[0] == 1, "one sequence at a time"
        generated = input_ids[0, self.prompt_length :].tolist()
        for token in generated[self.fed :]:
            assert self.matcher.consume_token(token), self.matcher.get_error()
        self.fed = len(generated)
        allowed = torch.frombuffer(bytearray(self.matcher.compute_logit_bias()), dtype=torch.uint8)
        assert self.matcher.get_error() == "", self.matcher.get_error()
        keep = torch.zeros(scores.shape[-1], dtype=torch.bool)
        width = min(len(allowed), scores.shape[-1])
        keep[:width] = allowed[:width] > 0
        return scores.masked_fill(~keep, float("-inf"))  # type: ignore[return-value]


class ConstrainedReference:
    """Greedy replies of the model in `model_dir`, free or under a `response_format`. The model's
    end of turn is its generation config's EOS (as a chat server stops on), which is also the
    only token the grammar allows once the JSON is complete."""

    def __init__(self, model_dir: Path) -> None:
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True).eval()
        eos = self.model.generation_config.eos_token_id
        self.eos: list[int] = eos if isinstance(eos, list) else [eos]
        self._lltokenizer: llguidance.LLTokenizer | None = None

    @property
    def lltokenizer(self) -> llguidance.LLTokenizer:
        """llguidance's view of the tokenizer (a walk over the vocabulary: built on first use)."""
        if self._lltokenizer is None:
            self._lltokenizer = llguidance.hf.from_tokenizer(
                cast(Any, self.tokenizer), n_vocab=self.model.config.vocab_size, eos_token=self.eos
            )
        return self._lltokenizer

    def generate(
        self,
        messages: list[dict[str, Any]],
        max_tokens: int,
        response_format: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """The reply's text, as `generate` writes it (special tokens left out); `tools` are given
        to the chat template as they are."""
        inputs = cast(
            "BatchEncoding",
            self.tokenizer.apply_chat_template(
                messages, tools=cast(Any, tools), add_generation_prompt=True, return_tensors="pt", return_dict=True
            ),
        )
        prompt_length = inputs["input_ids"].shape[1]
        processors = LogitsProcessorList()
        if response_format is not None:
            grammar = self.grammar(messages, response_format)
            matcher = llguidance.LLMatcher(self.lltokenizer, grammar, log_level=0)
            assert not matcher.is_error(), matcher.get_error()
            processors.append(GrammarMask(matcher, prompt_length))
        with torch.no_grad():
            out = self.model.generate(
                **inputs,
                max_new_tokens=max_tokens,
                do_sample=False,
                eos_token_id=self.eos,
                logits_processor=processors,
            )
        return str(self.tokenizer.decode(out[0, prompt_length:], skip_special_tokens=True))

    @staticmethod
    def grammar(messages: list[dict[str, Any]], response_format: dict[str, Any]) -> str:
        """actq's grammar text for the response format (a JSON schema: the tool format is not used)."""
        request = JobRequest.model_validate(
            {"model": "reference", "messages": messages, "max_tokens": 1, "response_format": response_format}
        )
        grammar = grammar_for(request, None)
        assert grammar is not None, f"no grammar for {json.dumps(response_format)}"
        return grammar
