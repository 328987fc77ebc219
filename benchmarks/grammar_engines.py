"""llguidance against xgrammar on the CPU, side by side, with the server's default tokenizer.

For each engine, and llguidance / xgrammar (above 1: llguidance slower): tokenizer setup; the
time to a matcher and its first mask of a nested JSON schema (with $defs and $ref), an anyOf
over 8 tool calls and a small GBNF grammar, cold (never seen) and cached (llguidance: a copy of a
template matcher; xgrammar: a hit in its compiler's cache); the mask time per decode step at
batch 32 and 1, each matcher walking the tokens of valid documents of the nested schema, one
batched call a step; the special tokens a mask allows inside a JSON string. JSON is compiled as
pyserve compiles it (compact). Needs llguidance, xgrammar, torch and transformers:

    /tmp/gram-venv/bin/python benchmarks/grammar_engines.py --tokenizer /tmp/gram-bench/tok
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import random
import statistics
import time
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any

import llguidance as llg
import llguidance.torch as llt
import numpy as np
import transformers
import xgrammar as xgr
from llguidance.gbnf_to_lark import gbnf_to_lark

# as pyserve.grammars.JSON_OPTIONS: the same compact JSON from both engines
LLG_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
XGR_JSON = {"any_whitespace": False, "separators": (", ", ": ")}
STATS = {"mean": np.mean, "p50": np.median, "p99": lambda t: np.percentile(t, 99)}


def obj(properties: dict, required: list[str] | None = None) -> dict:
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties) if required is None else required,
        "additionalProperties": False,
    }


STR, KINDS, ROLES = {"type": "string"}, ["home", "work", "mobile"], ["admin", "user", "guest"]
PERSON = obj(
    {
        "name": STR,
        "age": {"type": "integer", "minimum": 0},
        "email": {"anyOf": [STR, {"type": "null"}]},
        "tags": {"type": "array", "items": STR},
        "address": {"$ref": "#/$defs/Address"},
        "phones": {"type": "array", "items": {"$ref": "#/$defs/Phone"}},
        "role": {"enum": ROLES},
        "active": {"type": "boolean"},
    }
)
PERSON["$defs"] = {  # as pydantic writes a model with nested ones
    "Address": obj({"street": STR, "city": STR, "zip": STR}),
    "Phone": obj({"kind": {"enum": KINDS}, "number": STR}),
}


def tool(k: int) -> dict:
    types = ["string", "integer", "number", "boolean"][: 2 + k % 3]
    params = {f"p{j}": {"type": t} for j, t in enumerate(types)}
    params["mode"] = {"enum": ["fast", "slow", "auto"]}
    params["items"] = {"type": "array", "items": {"type": "string"}, "maxItems": 10}
    return obj({"name": {"const": f"tool_{k}"}, "arguments": obj(params, ["p0", "mode"])})


GBNF = r"""root ::= "SELECT " columns " FROM " ident where? ";"
columns ::= "*" | ident (", " ident)*
where ::= " WHERE " cond (" AND " cond)*
cond ::= ident " " op " " value
op ::= "=" | "<" | ">" | "<=" | ">=" | "!="
value ::= number | string
number ::= "-"? [0-9]+ ("." [0-9]+)?
string ::= "'" [^'\n]* "'"
ident ::= [a-zA-Z_] [a-zA-Z0-9_]{0,30}
"""
GRAMMARS = {
    "nested JSON schema": ("json", json.dumps(PERSON)),
    "8-tool anyOf schema": ("json", json.dumps({"anyOf": [tool(k) for k in range(8)]})),
    "GBNF (SQL, 9 rules)": ("gbnf", GBNF),
}
NAMES = ["Alice Smith", "Bob Okafor", "Carla Nguyen", "Dmitri Müller", "Hiro Tanaka", "José Rossi"]
WORDS = ["engineering", "remote", "vip", "on-call", "manager", "night shift", "EMEA", "APAC"]
CITIES = ["Springfield", "Paris", "London", "New York", "São Paulo", "Lagos", "Tokyo"]


def person_docs(n: int) -> list[str]:
    """``PERSON`` documents as pyserve prints them, in UTF-8 (llguidance refuses \\u escapes)."""
    rng = random.Random(0)
    docs = []
    for _ in range(n):
        name, zip_code = rng.choice(NAMES), f"{rng.randrange(10**5):05d}"
        doc = {
            "name": name,
            "age": rng.randint(0, 99),
            "email": f"{name.split()[0].lower()}@example.com" if rng.random() < 0.7 else None,
            "tags": rng.sample(WORDS, rng.randint(0, 4)),
            "address": {"street": "1 Main St", "city": rng.choice(CITIES), "zip": zip_code},
            "phones": [{"kind": rng.choice(KINDS), "number": f"555-{k:04d}"} for k in range(3)],
            "role": rng.choice(ROLES),
            "active": rng.random() < 0.5,
        }
        doc["phones"] = doc["phones"][: rng.randint(0, 3)]
        docs.append(json.dumps(doc, ensure_ascii=False))
    return docs


class Engine:
    """The few calls a server makes, the same for both engines."""

    def __init__(self, name: str, hf, tokenizer_json: str) -> None:
        self.name, self.hf = name, hf
        if name == "llguidance":
            self.tok = llg.LLTokenizer(tokenizer_json, eos_token=hf.eos_token_id)
            self.executor = llg.LLExecutor()  # as pyserve's worker: the default thread pool
            self.vocab = self.tok.vocab_size
            m = llg.LLMatcher
            self.copy, self.consume, self.finished = m.deep_copy, m.consume_token, m.is_stopped
        else:
            self.info = xgr.TokenizerInfo.from_huggingface(hf)
            self.compiler = xgr.GrammarCompiler(self.info)
            self.executor = xgr.BatchGrammarMatcher("auto")
            self.vocab = self.info.vocab_size
            m = xgr.GrammarMatcher
            self.copy, self.consume, self.finished = m.fork, m.accept_token, m.is_terminated

    def compile(self, kind: str, text: str, compiler=None):
        """A matcher for a grammar text (for xgrammar through ``compiler``'s cache)."""
        if self.name == "llguidance":
            if kind == "json":
                g = llg.LLMatcher.grammar_from_json_schema(text, LLG_JSON)
            else:
                g = llg.LLMatcher.grammar_from_lark(gbnf_to_lark(text))
            m = llg.LLMatcher(self.tok, g, log_level=0)
            if m.is_error():
                raise ValueError(m.get_error())
            return m
        c = compiler or self.compiler
        cg = c.compile_json_schema(text, **XGR_JSON) if kind == "json" else c.compile_grammar(text)
        return xgr.GrammarMatcher(cg)

    def fill(self, matchers: list, bitmask) -> None:
        if self.name == "llguidance":
            pairs = [(m, i) for i, m in enumerate(matchers)]
            llt.fill_next_token_bitmask_par(self.executor, pairs, bitmask)
        else:
            self.executor.batch_fill_next_token_bitmask(matchers, bitmask)

    def bitmask(self, rows: int):
        return llt.allocate_token_bitmask(rows, self.vocab)  # the same int32 layout for both


def timed(fn: Callable, *args) -> tuple[Any, float]:
    t = time.perf_counter()
    return fn(*args), (time.perf_counter() - t) * 1000


def allowed(bitmask, row: int, token: int) -> bool:
    return bool((int(bitmask[row, token >> 5]) >> (token & 31)) & 1)


def compile_times(engine: Engine, kind: str, text: str, reps: int) -> tuple[list, list]:
    """Milliseconds to a matcher and its first mask: cold, then cached."""
    bm = engine.bitmask(1)

    def first_mask(make: Callable, *args) -> None:
        engine.fill([make(*args)], bm)

    cold, cached = [], []
    for _ in range(reps):
        # xgrammar: a new compiler, its cache empty (llguidance has no cache)
        compiler = xgr.GrammarCompiler(engine.info) if engine.name == "xgrammar" else None
        cold_args = (engine.compile, kind, text, compiler)
        cold.append(timed(first_mask, *cold_args)[1])
        seen = (engine.copy, engine.compile(kind, text)) if compiler is None else cold_args
        cached.append(timed(first_mask, *seen)[1])
    return cold, cached


def mask_times(engine: Engine, docs: list[list[int]], batch: int, steps: int, seed: int) -> list:
    """Milliseconds of the one batched mask call at each step; every planned token must be
    allowed (else the engine rejected a valid document)."""
    template = engine.compile(*GRAMMARS["nested JSON schema"])
    matchers = [engine.copy(template) for _ in range(batch)]
    feed = itertools.islice(itertools.cycle(docs), seed, None)
    plans, pos = [[*next(feed), engine.hf.eos_token_id] for _ in range(batch)], [0] * batch
    bm = engine.bitmask(batch)
    times = []
    gc.disable()
    try:
        for _ in range(steps):
            t = time.perf_counter()
            engine.fill(matchers, bm)
            times.append((time.perf_counter() - t) * 1000)
            for i, m in enumerate(matchers):
                token = plans[i][pos[i]]
                if not allowed(bm, i, token) or not engine.consume(m, token):
                    raise RuntimeError(f"{engine.name} rejected token {token} of a valid document")
                pos[i] += 1
                if pos[i] == len(plans[i]):
                    if not engine.finished(m):
                        raise RuntimeError(f"{engine.name}: not finished after the document")
                    matchers[i] = engine.copy(template)
                    plans[i], pos[i] = [*next(feed), engine.hf.eos_token_id], 0
    finally:
        gc.enable()
    return times


def specials_in_string(engine: Engine) -> str:
    """How many of the tokenizer's special tokens the mask allows just inside a JSON string."""
    m = engine.compile(*GRAMMARS["nested JSON schema"])
    for token in engine.hf.encode('{"name": "', add_special_tokens=False):
        engine.consume(m, token)
    engine.fill([m], bm := engine.bitmask(1))
    special = sorted(set(engine.hf.all_special_ids) | set(engine.hf.added_tokens_decoder))
    return f"{sum(allowed(bm, 0, t) for t in special)} of {len(special)}"


def span(values: list[float], digits: int = 3) -> str:
    lo, hi = min(values), max(values)
    lo_text, hi_text = f"{lo:.{digits}f}", f"{hi:.{digits}f}"
    return lo_text if lo_text == hi_text else f"{lo_text}–{hi_text}"


def row(label: str, llg_ms: list[float], xgr_ms: list[float], digits: int = 3) -> None:
    ratio = statistics.median(llg_ms) / statistics.median(xgr_ms)
    print(f"| {label} | {span(llg_ms, digits)} | {span(xgr_ms, digits)} | {ratio:.2f} |")


def find_tokenizer(explicit: str | None) -> Path:
    if explicit:
        return Path(explicit).parent if Path(explicit).is_file() else Path(explicit)
    try:
        from pyserve import model_files

        return model_files.tokenizer_dir(model_files.resolve_model(None))
    except (ImportError, ValueError) as e:  # ModelFilesError is a ValueError
        raise SystemExit(f"no default tokenizer ({e}): pass --tokenizer PATH") from e


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--tokenizer", help="tokenizer.json or its directory (default: pyserve's)")
    p.add_argument("--reps", type=int, default=3, help="repetitions; tables show their range")
    p.add_argument("--steps", type=int, default=1000, help="decode steps at batch 32 (x4 at 1)")
    args = p.parse_args(argv)

    tok_dir = find_tokenizer(args.tokenizer)
    tokenizer_json = (tok_dir / "tokenizer.json").read_text()
    versions = ", ".join(f"{n} {metadata.version(n)}" for n in ("llguidance", "xgrammar", "torch"))
    print(f"tokenizer: {tok_dir}; {versions}")
    setup: dict[str, list[float]] = {"hf": [], "llguidance": [], "xgrammar": []}
    for _ in range(args.reps):
        hf, ms = timed(transformers.AutoTokenizer.from_pretrained, tok_dir)
        setup["hf"].append(ms)
        engines = [timed(Engine, name, hf, tokenizer_json) for name in ("llguidance", "xgrammar")]
        for engine, ms in engines:
            setup[engine.name].append(ms)
    engines = [engine for engine, _ in engines]
    for e in engines:  # the first mask in a process builds lazy state: not a grammar's cost
        e.fill([e.compile(*GRAMMARS["nested JSON schema"])], e.bitmask(1))

    print("\n| ms (range) | llguidance | xgrammar | llg/xgr |\n|---|---|---|---|")
    row("tokenizer setup (engine's own)", setup["llguidance"], setup["xgrammar"], 1)
    print(f"| transformers AutoTokenizer (xgrammar needs it) | – | {span(setup['hf'], 1)} | – |")
    for name, (kind, text) in GRAMMARS.items():
        (lc, lh), (xc, xh) = (compile_times(e, kind, text, args.reps) for e in engines)
        row(f"{name}: compile cold, to first mask", lc, xc)
        row(f"{name}: cached, to first mask", lh, xh)

    docs = [hf.encode(d, add_special_tokens=False) for d in person_docs(64)]
    lengths = [len(d) for d in docs]
    print(
        f"\nmask per step, ms (range over runs); documents of {min(lengths)}–{max(lengths)} tokens"
    )
    print("\n| batch | stat | llguidance | xgrammar | llg/xgr |\n|---|---|---|---|---|")
    for batch, steps in ((32, args.steps), (1, 4 * args.steps)):
        runs = {
            e.name: [mask_times(e, docs, batch, steps, r) for r in range(args.reps)]
            for e in engines
        }
        for stat, fn in STATS.items():
            row(f"{batch} | {stat}", *([fn(t) for t in runs[e.name]] for e in engines))
    specials = ", ".join(f"{e.name} {specials_in_string(e)}" for e in engines)
    print(f"\nspecial tokens allowed inside a JSON string: {specials}")


if __name__ == "__main__":
    main()
