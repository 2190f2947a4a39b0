"""Constrained decoding libraries compared for actq (issue 26): xgrammar, llguidance, outlines-core.

For each library installed, with the built-in model's tokenizer (SmolLM2-135M, logits width from its
config): compile three grammars (a tool call's JSON schema, a Pydantic schema with nested objects,
arrays, enums, numbers and optionals, and generic JSON as for `json_object`), then time the per-step
cost of filling the allowed-token bitmask for every row and applying it to a [batch, vocab] float32
logits tensor in one op, at batch 1 and 16 (independent matchers advanced along a valid sample
completion, so the states are realistic), against an unconstrained step's argmax over the same
logits. Medians over repeats. Then a correctness check: greedy walks over random logits under the
mask must produce text that parses and validates (pydantic / jsonschema). Libraries not installed
are skipped with a line saying so. CPU only; no model forward is run.

    python bench/bench_grammar.py [--repeats 5] [--batches 1 16] [--walks 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import enum
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, Field

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


class Status(enum.StrEnum):
    pending = "pending"
    shipped = "shipped"
    cancelled = "cancelled"


class Customer(BaseModel):
    name: str
    email: str | None = None
    vip: bool


class Item(BaseModel):
    sku: str
    qty: int = Field(ge=1, le=100)
    price: float


class Order(BaseModel):
    id: int
    customer: Customer
    items: list[Item] = Field(min_length=1, max_length=4)
    status: Status
    tags: list[str]


TOOL_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"const": "calculator"},
        "arguments": {
            "type": "object",
            "properties": {"expression": {"type": "string"}},
            "required": ["expression"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "arguments"],
    "additionalProperties": False,
}
# "additionalProperties": true spelled out: xgrammar 0.2.8 with any_whitespace=False otherwise
# accepts at most one property ({"a": 42, "b": 1} rejected), even with strict_mode=False
OBJECT_SCHEMA = {"type": "object", "additionalProperties": True}

SAMPLES = {
    "tool": {"name": "calculator", "arguments": {"expression": "(48 / 2) * 3 + 17 - 4 ** 2"}},
    "pydantic": {
        "id": 1042,
        "customer": {"name": "Ada Lovelace", "email": "ada@example.com", "vip": True},
        "items": [
            {"sku": "AX-100", "qty": 2, "price": 19.99},
            {"sku": "BZ-7", "qty": 1, "price": 250.0},
        ],
        "status": "shipped",
        "tags": ["gift", "express"],
    },
    "json_object": {"answer": 42, "steps": ["add", "multiply"], "ok": True, "note": None},
}


def grammars() -> dict[str, dict[str, Any]]:
    return {
        "tool": TOOL_SCHEMA,
        "pydantic": Order.model_json_schema(),
        "json_object": OBJECT_SCHEMA,
    }


def validate(kind: str, text: str) -> None:
    data = json.loads(text)
    if kind == "pydantic":
        Order.model_validate(data)
    else:
        import jsonschema

        jsonschema.validate(data, grammars()[kind])


# --- library adapters: compile(schema) -> grammar; matcher(grammar) -> m; fill(ms, bitmask);
# accept(m, tok); done(m); apply(logits, bitmask) ---


class Lib:
    name = ""
    version = ""
    separators = (",", ":")

    def __init__(self, tok, vocab: int) -> None:
        self.tok, self.vocab = tok, vocab
        self.eos = tok.eos_token_id

    def bitmask(self, batch: int) -> torch.Tensor:
        return torch.full((batch, (self.vocab + 31) // 32), -1, dtype=torch.int32)


class XGrammar(Lib):
    name = "xgrammar"
    # xgrammar 0.2.8's separators=(",", ":") breaks generic values (["a","b"] rejected in an
    # additionalProperties object), so its own default with any_whitespace=False
    separators = (", ", ": ")

    def __init__(self, tok, vocab: int) -> None:
        super().__init__(tok, vocab)
        from importlib.metadata import version

        import xgrammar as xgr

        self.xgr, self.version = xgr, version("xgrammar")
        self.info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab)
        self.batch_matcher = xgr.BatchGrammarMatcher()

    def compile(self, schema: dict) -> Any:
        # cache_enabled=False: measure a cold compile every repeat
        c = self.xgr.GrammarCompiler(self.info, cache_enabled=False)
        # compact whitespace, as the engine would use (the default allows unbounded whitespace);
        # compile_builtin_json_grammar() would allow any JSON value, not only an object
        return c.compile_json_schema(json.dumps(schema), any_whitespace=False, strict_mode=False)

    def matcher(self, g):
        return self.xgr.GrammarMatcher(g)

    def fill(self, ms, bm):
        if len(ms) == 1:
            ms[0].fill_next_token_bitmask(bm, 0)
        else:
            self.batch_matcher.batch_fill_next_token_bitmask(ms, bm)

    def accept(self, m, t) -> bool:
        return m.accept_token(t)

    def done(self, m) -> bool:
        return m.is_terminated()

    def apply(self, logits, bm):
        self.xgr.apply_token_bitmask_inplace(logits, bm)


class LLGuidance(Lib):
    name = "llguidance"

    def __init__(self, tok, vocab: int) -> None:
        super().__init__(tok, vocab)
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self.llg, self.lt = llguidance, llguidance.torch
        self.version = llguidance.__version__
        self.lltok = llguidance.hf.from_tokenizer(tok, n_vocab=vocab)
        self.executor = llguidance.LLExecutor()

    def compile(self, schema: dict) -> Any:
        # compact whitespace, as the engine would use (the default allows unbounded whitespace)
        g = self.llg.LLMatcher.grammar_from_json_schema(json.dumps(schema), overrides={"whitespace_flexible": False})
        # the matcher's constructor is where llguidance builds the parser (lazily, no token tables)
        m = self.llg.LLMatcher(self.lltok, g)
        if m.is_error():
            raise ValueError(m.get_error())
        return g

    def matcher(self, g):
        return self.llg.LLMatcher(self.lltok, g)

    def fill(self, ms, bm):
        if len(ms) == 1:
            self.lt.fill_next_token_bitmask(ms[0], bm, 0)
        else:
            self.lt.fill_next_token_bitmask_par(self.executor, [(m, i) for i, m in enumerate(ms)], bm)

    def accept(self, m, t) -> bool:
        return m.consume_token(t)

    def done(self, m) -> bool:
        return m.is_stopped()

    def apply(self, logits, bm):
        self.lt.apply_token_bitmask_inplace(logits, bm)


class OutlinesCore(Lib):
    name = "outlines-core"

    def __init__(self, tok, vocab: int) -> None:
        super().__init__(tok, vocab)
        from importlib.metadata import version

        import outlines_core

        self.oc, self.version = outlines_core, version("outlines-core")
        # as outlines does: every token's text (byte-level BPE decoded), EOS left out of the map
        vmap: dict[str, list[int]] = {}
        for token, tid in tok.get_vocab().items():
            if tid == self.eos or tid >= vocab:
                continue
            vmap.setdefault(tok.convert_tokens_to_string([token]), []).append(tid)
        self.vocabulary = outlines_core.Vocabulary(self.eos, vmap)
        try:
            import llguidance.torch as lt

            self._apply = lt.apply_token_bitmask_inplace
        except ImportError:
            self._apply = None

    def compile(self, schema: dict) -> Any:
        regex = self.oc.json_schema.build_regex_from_schema(json.dumps(schema))
        return self.oc.Index(regex, self.vocabulary)

    def matcher(self, g):
        return self.oc.Guide(g)

    def fill(self, ms, bm):
        row = bm.stride(0)
        for i, m in enumerate(ms):
            m.write_mask_into(bm.data_ptr() + 4 * i * row, row, 4)

    def accept(self, m, t) -> bool:
        if t == self.eos:  # allowed in a final state, but advancing on it raises
            return m.is_finished()
        m.advance(t, return_tokens=False)
        return True

    def done(self, m) -> bool:
        return m.is_finished()

    def apply(self, logits, bm):
        if self._apply is not None:
            self._apply(logits, bm)
            return
        bits = (bm.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
        allowed = bits.reshape(bm.shape[0], -1)[:, : logits.shape[1]].bool()
        logits.masked_fill_(~allowed, float("-inf"))


LIBS = {"xgrammar": XGrammar, "llguidance": LLGuidance, "outlines-core": OutlinesCore}


def load_tokenizer():
    from transformers import AutoTokenizer

    try:
        from shared.settings import Settings
        from worker.model.loading import ensure_smollm2

        d = ensure_smollm2(Settings().model_cache_dir)
    except Exception as e:
        raise SystemExit(f"cannot find the built-in SmolLM2: {e}") from e
    tok = AutoTokenizer.from_pretrained(d)
    vocab = json.loads((d / "config.json").read_text())["vocab_size"]
    return tok, vocab


def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def sample_tokens(tok, kind: str, separators: tuple[str, str]) -> list[int]:
    text = json.dumps(SAMPLES[kind], separators=separators)
    return tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]


def time_steps(lib: Lib, g, toks: list[int], batch: int, repeats: int) -> dict[str, float]:
    """Per step over the sample: mask fill + apply for `batch` rows, the advance of all rows,
    and an unconstrained argmax over the same [batch, vocab] logits."""
    gen = torch.Generator().manual_seed(0)
    logits0 = torch.randn(batch, lib.vocab, generator=gen)
    bm = lib.bitmask(batch)
    mask_t, acc_t, base_t = [], [], []
    for _ in range(repeats):
        ms = [lib.matcher(g) for _ in range(batch)]
        per_mask, per_acc, per_base = [], [], []
        for t in toks:
            logits = logits0.clone()
            t0 = time.perf_counter()
            torch.argmax(logits, dim=-1)
            t1 = time.perf_counter()
            lib.fill(ms, bm)
            lib.apply(logits, bm)
            torch.argmax(logits, dim=-1)
            t2 = time.perf_counter()
            for m in ms:
                if not lib.accept(m, t):
                    raise RuntimeError(f"{lib.name}: sample token {t} rejected")
            t3 = time.perf_counter()
            per_base.append(t1 - t0)
            per_mask.append(t2 - t1)
            per_acc.append(t3 - t2)
        mask_t.append(med(per_mask))
        acc_t.append(med(per_acc))
        base_t.append(med(per_base))
    return {"mask_us": med(mask_t) * 1e6, "accept_us": med(acc_t) * 1e6, "argmax_us": med(base_t) * 1e6}


def closing_ids(tok, vocab: int) -> torch.Tensor:
    """Tokens that end strings, numbers or containers: nudged up late in a random walk so it ends."""
    ids = [tok.eos_token_id]
    for token, tid in tok.get_vocab().items():
        s = tok.convert_tokens_to_string([token])
        if tid < vocab and s and s.strip() and set(s.strip()) <= set('"}],:'):
            ids.append(tid)
    return torch.tensor(sorted(set(ids)))


def walk(lib: Lib, g, seed: int, close: torch.Tensor, max_tokens: int = 400) -> tuple[str, bool]:
    gen = torch.Generator().manual_seed(seed)
    m = lib.matcher(g)
    bm = lib.bitmask(1)
    out: list[int] = []
    for step in range(max_tokens):
        logits = torch.randn(1, lib.vocab, generator=gen)
        if step >= 30:
            logits[0, close] += 8.0
        lib.fill([m], bm)
        lib.apply(logits, bm)
        t = int(torch.argmax(logits, dim=-1))
        if not lib.accept(m, t):
            raise RuntimeError(f"{lib.name}: masked argmax token {t} rejected")
        if t == lib.eos:
            break
        out.append(t)
        if lib.done(m):
            break
    return lib.tok.decode(out), lib.done(m)


REFUSALS = {
    "recursive $ref": {
        "$defs": {"n": {"type": "object", "properties": {"c": {"$ref": "#/$defs/n"}}}},
        "$ref": "#/$defs/n",
    },
    "not": {"not": {"type": "string"}},
    "pattern lookahead": {"type": "string", "pattern": "(?=a)a+"},
    "if/then": {"if": {"type": "string"}, "then": {"minLength": 2}},
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--walks", type=int, default=5, help="random greedy walks per grammar")
    ap.add_argument("--libs", nargs="+", default=list(LIBS))
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(1)

    tok, vocab = load_tokenizer()
    print(f"tokenizer: len {len(tok)}, model logits width {vocab}, eos {tok.eos_token_id}")
    close = closing_ids(tok, vocab)
    results: list[dict[str, Any]] = []
    checks: list[dict[str, Any]] = []
    refusals: dict[str, dict[str, str]] = {}
    for name in args.libs:
        try:
            t0 = time.perf_counter()
            lib = LIBS[name](tok, vocab)
            setup = time.perf_counter() - t0
        except ImportError as e:
            print(f"skip {name}: not installed ({e})")
            continue
        print(f"{name} {lib.version}: tokenizer setup {setup * 1e3:.0f} ms")
        for kind, schema in grammars().items():
            ct = []
            try:
                for _ in range(max(1, min(args.repeats, 3))):
                    t0 = time.perf_counter()
                    g = lib.compile(schema)
                    ct.append(time.perf_counter() - t0)
            except Exception as e:  # noqa: BLE001
                print(f"  {kind}: compile failed: {type(e).__name__}: {str(e)[:200]}")
                continue
            toks = sample_tokens(tok, kind, lib.separators)
            for b in args.batches:
                r = time_steps(lib, g, toks, b, args.repeats)
                r.update(lib=name, grammar=kind, batch=b, compile_ms=med(ct) * 1e3, steps=len(toks))
                results.append(r)
            ok = 0
            for seed in range(args.walks):
                text, finished = walk(lib, g, seed, close)
                try:
                    validate(kind, text)
                    ok += 1
                except Exception as e:  # noqa: BLE001
                    print(f"  walk {kind} seed {seed} invalid (finished={finished}): {e!s:.120} :: {text[:160]!r}")
            checks.append({"lib": name, "grammar": kind, "valid": ok, "walks": args.walks, "last": text[:120]})
        refusals[name] = {}
        for what, schema in REFUSALS.items():
            try:
                lib.compile(schema)
                refusals[name][what] = "accepted"
            except Exception as e:  # noqa: BLE001
                refusals[name][what] = f"{type(e).__name__}: {str(e).splitlines()[0][:110]}"

    print()
    print("per step, medians over repeats (mask = fill bitmask for all rows + apply + argmax;")
    print("ratio = mask / unconstrained argmax over the same [batch, vocab] logits;")
    print("extra us/row = (mask - argmax + accept) / batch: what constraining adds per row and token)")
    hdr = (
        f"{'library':14} {'grammar':12} {'batch':>5} {'compile ms':>10} {'mask us':>9} "
        f"{'accept us':>9} {'argmax us':>9} {'ratio':>6} {'extra us/row':>12}"
    )
    print(hdr)
    print("-" * len(hdr))
    for r in results:
        extra = (r["mask_us"] - r["argmax_us"] + r["accept_us"]) / r["batch"]
        print(
            f"{r['lib']:14} {r['grammar']:12} {r['batch']:>5} {r['compile_ms']:>10.1f} "
            f"{r['mask_us']:>9.1f} {r['accept_us']:>9.1f} {r['argmax_us']:>9.1f} "
            f"{r['mask_us'] / r['argmax_us']:>6.1f} {extra:>12.1f}"
        )
    print()
    print("correctness: random-logit greedy walks under the mask that parse and validate")
    for c in checks:
        print(f"  {c['lib']:14} {c['grammar']:12} {c['valid']}/{c['walks']}  e.g. {c['last']!r}")
    print()
    print("schema features outside the subset:")
    for name, rs in refusals.items():
        for what, res in rs.items():
            print(f"  {name:14} {what:18} {res}")
    if args.json:
        args.json.write_text(json.dumps({"results": results, "checks": checks, "refusals": refusals}, indent=1))
    bad = [c for c in checks if c["valid"] != c["walks"]]
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
