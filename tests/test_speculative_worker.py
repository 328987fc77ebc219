"""Speculative decoding in the worker: verify entries give exactly plain decoding's output.

A drafting driver (an OfflineEngine that calls ``planner.set_draft`` before each plan) runs a
tiny random-weight Llama with drafts chosen by a policy: the true continuation (taken from a
plain run: all accepted), the same corrupted at one place, random tokens, or a mix per request.
Whatever the drafts, greedy and seeded outputs, logprobs and finishes equal plain decoding's,
and the core's KV accounting stays exact.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import worker_testlib
from tiny_models import random_llama
from worker_testlib import (  # noqa: F401 (an autouse fixture)
    TINY_EOS,
    TINY_VOCAB,
    assert_same_outputs,
    i32,
    make_step,
    make_tiny_llama,
    one_torch_thread,
)

from pyserve import model_files
from pyserve.wire.main_to_worker import Grammar, NewRequest, SamplingParams, step_from_plan
from pyserve.wire.worker_to_detok import FINISH_NONE, StepTokens
from pyserve.worker.executor import StepExecutor
from pyserve.worker.grammar_masks import GrammarMasks
from pyserve.worker.offline import OfflineEngine, Output
from pyserve.worker.state import RequestTable

K = 4  # the most drafts a verify entry checks
BLOCK = 4
NEW_TOKENS = 24

# policy(rid's continuation in a plain run or None, output index of the first draft, k, rng)
Policy = Callable[[list[int] | None, int, int, random.Random], list[int]]


def true_drafts(cont: list[int] | None, at: int, k: int, rng: random.Random) -> list[int]:
    return list(cont[at : at + k]) if cont else []


def corrupted_drafts(cont: list[int] | None, at: int, k: int, rng: random.Random) -> list[int]:
    drafts = true_drafts(cont, at, k, rng) or random_drafts(cont, at, k, rng)
    where = rng.randrange(len(drafts))
    drafts[where] = (drafts[where] + rng.randrange(1, TINY_VOCAB)) % TINY_VOCAB
    return drafts


def random_drafts(cont: list[int] | None, at: int, k: int, rng: random.Random) -> list[int]:
    return [rng.randrange(TINY_VOCAB) for _ in range(rng.randint(1, k))]


def mixed_drafts(cont: list[int] | None, at: int, k: int, rng: random.Random) -> list[int]:
    policy = rng.choice([true_drafts, corrupted_drafts, random_drafts, lambda *_: []])
    return policy(cont, at, k, rng)


POLICIES = {
    "true": true_drafts,
    "corrupted": corrupted_drafts,
    "random": random_drafts,
    "mixed": mixed_drafts,
}


class DraftingEngine(OfflineEngine):
    """OfflineEngine whose running requests get drafts before each plan.

    Drafts come from ``policy`` for each request whose prefill is planned, with no verify entry
    unreported (and, serially, no entry in flight at all); ``continuations`` maps a prompt to
    its plain output, which the policy may copy.
    """

    def __init__(
        self,
        model: str,
        policy: Policy,
        continuations: dict[tuple[int, ...], list[int]] | None = None,
        seed: int = 0,
        **options,
    ) -> None:
        options.setdefault("num_blocks", 512)
        super().__init__(
            model, block_size=BLOCK, check_invariants=True, max_draft_tokens=K, **options
        )
        self.policy = policy
        self.continuations = continuations or {}
        self.rng = random.Random(seed)
        self.verify_entries = 0
        self.drafted_tokens = 0
        self.emitted_by_verify = 0  # tokens reported for verify entries (accepted + 1 each)
        self._verifying: dict[int, set[int]] = {}  # step id -> rids verifying in it

    def draft(self, rids: set[int]) -> None:
        for rid in sorted(rids):
            info = self.planner.request(rid)
            if info["state"] != "running" or info["planned_samples"] < 1 or info["verifying"]:
                continue
            if not self.overlap and info["inflight_steps"]:
                continue
            at = info["planned_samples"]  # the output index the first draft guesses
            k = min(K, info["max_new_tokens"] - at - 1)
            if k < 1:
                continue
            prompt = tuple(self.executor.requests.get(rid).prompt_ids.tolist())
            drafts = self.policy(self.continuations.get(prompt), at, k, self.rng)[:k]
            if drafts:
                self.planner.set_draft(rid, drafts)

    def _run(self, outputs: dict[int, Output]) -> None:
        unfinished = set(outputs)
        in_flight: deque[StepTokens] = deque()
        while unfinished:
            self.draft(unfinished)
            plan = self.planner.plan()
            self._check()
            if plan is None:
                assert in_flight, f"the planner stalled: {self.planner.stats()}"
                while in_flight:
                    self._report(in_flight.popleft(), outputs, unfinished)
                continue
            self._count_verify_entries(plan)
            in_flight.append(self.executor.execute(step_from_plan(plan)))
            self.steps_run += 1
            while len(in_flight) > (1 if self.overlap else 0):
                self._report(in_flight.popleft(), outputs, unfinished)
        while in_flight:
            self._report(in_flight.popleft(), outputs, unfinished)
        plan = self.planner.plan()
        if plan is not None:
            self._report(self.executor.execute(step_from_plan(plan)), outputs, unfinished)

    def _count_verify_entries(self, plan) -> None:
        verifying = set()
        for entry in plan.entries():
            if entry["is_decode"] and entry["num_tokens"] > 1:
                verifying.add(entry["rid"])
                self.drafted_tokens += entry["num_tokens"] - 1
        self.verify_entries += len(verifying)
        self._verifying[plan.step_id] = verifying

    def _report(self, result: StepTokens, outputs: dict[int, Output], unfinished: set[int]):
        verifying = self._verifying.pop(result.step_id, set())
        rids = np.frombuffer(result.rids, dtype="<i8").tolist()
        self.emitted_by_verify += sum(r in verifying for r in rids)
        super()._report(result, outputs, unfinished)


def assert_kv_accounting_is_exact(engine: OfflineEngine) -> None:
    planner = engine.planner
    planner.check_invariants()
    assert planner.num_running == planner.num_waiting == planner.num_inflight_steps == 0
    states = np.frombuffer(planner.block_states(), dtype=np.uint8)
    assert not (states == 1).any(), "blocks still owned by requests"
    assert len(engine.executor.requests) == 0


# ------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


def random_prompts(seed: int, shared_prefix: int = 0) -> list[list[int]]:
    return worker_testlib.random_prompts(seed, [3, 9, 14, 22, 31], shared_prefix)


def greedy(**kw) -> SamplingParams:
    kw.setdefault("max_new_tokens", NEW_TOKENS)
    return SamplingParams(temperature=0.0, ignore_eos=True, logprobs=True, top_logprobs=2, **kw)


def plain_run(model: Path, prompts, params, **options) -> list[Output]:
    engine = OfflineEngine(
        str(model), block_size=BLOCK, num_blocks=512, check_invariants=True, **options
    )
    return engine.generate(prompts, params)


def continuations(prompts, outputs: list[Output]) -> dict[tuple[int, ...], list[int]]:
    return {tuple(p): o.token_ids for p, o in zip(prompts, outputs, strict=True)}


# ------------------------------------------------------------------ greedy


@pytest.mark.parametrize("backend", ["auto", "torch"])
@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_greedy_output_equals_plain_decoding_whatever_the_drafts(
    tiny_model: Path, backend: str, policy: str
) -> None:
    prompts = random_prompts(1)
    want = plain_run(tiny_model, prompts, greedy(), backend=backend)
    engine = DraftingEngine(
        str(tiny_model), POLICIES[policy], continuations(prompts, want), backend=backend,
        overlap=False,
    )  # fmt: skip
    got = engine.generate(prompts, greedy())
    assert_same_outputs(got, want, policy)
    assert engine.verify_entries > 0
    if policy == "true":  # every draft accepted: k + 1 tokens a verify entry
        assert engine.emitted_by_verify == engine.drafted_tokens + engine.verify_entries
    if policy == "random":  # nearly all rejected, yet some step emits a token
        assert engine.emitted_by_verify >= engine.verify_entries
    assert_kv_accounting_is_exact(engine)


def test_greedy_with_drafts_set_while_decodes_are_in_flight(tiny_model: Path) -> None:
    """Overlap: drafts for a request whose plain decode is still unreported guess the tokens
    after it; the worker holds that decode's token as the verify entry's first input."""
    prompts = random_prompts(3)
    want = plain_run(tiny_model, prompts, greedy())
    for policy in ("true", "mixed"):
        engine = DraftingEngine(
            str(tiny_model), POLICIES[policy], continuations(prompts, want), overlap=True
        )
        assert_same_outputs(engine.generate(prompts, greedy()), want, f"overlap, {policy}")
        assert engine.verify_entries > 0
        assert_kv_accounting_is_exact(engine)


def test_greedy_with_prefix_hits_and_chunked_prefills(tiny_model: Path) -> None:
    prompts = random_prompts(2, shared_prefix=12)
    options = dict(chunked_prefill_size=5, max_prefill_tokens=11)
    want = plain_run(tiny_model, prompts, greedy(), **options)
    engine = DraftingEngine(
        str(tiny_model), mixed_drafts, continuations(prompts, want), overlap=False, **options
    )
    engine.generate([prompts[0]], greedy(max_new_tokens=2))  # caches the shared prefix
    got = engine.generate(prompts, greedy())
    assert all(o.cached_tokens >= 12 for o in got), [o.cached_tokens for o in got]
    assert_same_outputs(got, want, "prefix hits, chunks of 5")
    assert engine.verify_entries > 0
    assert_kv_accounting_is_exact(engine)


def test_greedy_on_the_triton_backend(tiny_model: Path) -> None:
    """The triton backend, in its interpreter here (conftest.py)."""
    prompts = random_prompts(4)[:3]
    params = greedy(max_new_tokens=10)
    want = plain_run(tiny_model, prompts, params, backend="triton")
    engine = DraftingEngine(
        str(tiny_model), mixed_drafts, continuations(prompts, want), backend="triton",
        overlap=False,
    )  # fmt: skip
    assert_same_outputs(engine.generate(prompts, params), want, "triton")
    assert engine.verify_entries > 0


class RecordingBroadcast:
    """Stands in for a tensor-parallel group: rank 0's tokens are these ones; records what
    was broadcast."""

    def __init__(self) -> None:
        self.sent: list[list[int]] = []

    def broadcast_tokens(self, token_ids: list[int]) -> list[int]:
        self.sent.append(list(token_ids))
        return list(token_ids)


def test_tensor_parallel_broadcast_carries_each_verify_entrys_tokens(tiny_model: Path) -> None:
    prompts = random_prompts(9)
    want = plain_run(tiny_model, prompts, greedy())
    engine = DraftingEngine(str(tiny_model), mixed_drafts, continuations(prompts, want),
                            overlap=False)  # fmt: skip
    engine.executor.tp = tp = RecordingBroadcast()
    assert_same_outputs(engine.generate(prompts, greedy()), want, "broadcast")
    assert engine.verify_entries > 0
    # at most one broadcast a step; a verify entry of k drafts sends k + 2 slots
    assert len(tp.sent) <= engine.steps_run
    assert sum(map(len, tp.sent)) >= engine.drafted_tokens + 2 * engine.verify_entries


# ------------------------------------------------------------------ seeded sampling


def seeded(seed: int, **kw) -> SamplingParams:
    base = dict(
        max_new_tokens=NEW_TOKENS, temperature=0.8, top_p=0.9, seed=seed, ignore_eos=True,
        logprobs=True, top_logprobs=3,
    )  # fmt: skip
    return SamplingParams(**{**base, **kw})


SEEDED = [
    seeded(1),
    seeded(2, top_k=20, min_p=0.05),
    seeded(3, repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.2),
    seeded(4, logit_bias={7: 5.0, 11: -100.0}, top_p=1.0),
    seeded(5, min_tokens=6, ignore_eos=False, temperature=1.2),
]


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_seeded_sampling_equals_plain_decoding_whatever_the_drafts(
    tiny_model: Path, policy: str
) -> None:
    prompts = random_prompts(5)
    want = plain_run(tiny_model, prompts, SEEDED)
    engine = DraftingEngine(
        str(tiny_model), POLICIES[policy], continuations(prompts, want), overlap=False
    )
    got = engine.generate(prompts, SEEDED)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.token_ids == w.token_ids, f"{policy}, prompt {i}"
    assert_same_outputs(got, want, policy)
    assert engine.verify_entries > 0
    assert_kv_accounting_is_exact(engine)


# ------------------------------------------------------------------ finishes


def test_a_stop_token_inside_an_accepted_run_ends_the_request_there(tiny_model: Path) -> None:
    prompts = random_prompts(6)
    free = plain_run(tiny_model, prompts, greedy())
    # Serially, with true drafts, verify entries emit output tokens 1..5, 6..10, ...: each
    # request stops at a token first seen at place 6..8, inside a run, not at its end
    params = []
    for out in free:
        place = next((t for t in range(6, 9) if out.token_ids[t] not in out.token_ids[:t]), None)
        assert place is not None, "no fresh token to stop at"
        params.append(greedy(stop_token_ids=[out.token_ids[place]]))
    want = plain_run(tiny_model, prompts, params)
    # drafts from the free run go past the stop token: all of them are accepted
    engine = DraftingEngine(str(tiny_model), true_drafts, continuations(prompts, free),
                            overlap=False)  # fmt: skip
    got = engine.generate(prompts, params)
    assert_same_outputs(got, want, "stop token")
    for out, p in zip(got, params, strict=True):
        assert out.finish_reason == "stop" and out.token_ids[-1] in p.stop_token_ids
        assert 7 <= len(out.token_ids) <= 9
    # what each verify entry accepted after its request's stop token was never reported
    assert engine.emitted_by_verify < engine.drafted_tokens + engine.verify_entries
    assert_kv_accounting_is_exact(engine)


@pytest.mark.parametrize("max_new_tokens", [1, 2, 5, 7])
def test_max_new_tokens_is_respected(tiny_model: Path, max_new_tokens: int) -> None:
    prompts = random_prompts(7)
    params = greedy(max_new_tokens=max_new_tokens)
    want = plain_run(tiny_model, prompts, greedy(max_new_tokens=NEW_TOKENS))
    engine = DraftingEngine(str(tiny_model), true_drafts, continuations(prompts, want),
                            overlap=False)  # fmt: skip
    got = engine.generate(prompts, params)
    for out, full in zip(got, want, strict=True):
        assert out.token_ids == full.token_ids[:max_new_tokens]
        assert out.finish_reason == "length"
    assert_kv_accounting_is_exact(engine)


def test_aborts_while_verify_entries_are_in_flight_leave_nothing_behind(tiny_model: Path) -> None:
    prompts = random_prompts(8)
    want = plain_run(tiny_model, prompts, greedy())
    engine = DraftingEngine(str(tiny_model), true_drafts, continuations(prompts, want))
    planner, executor = engine.planner, engine.executor
    rids = list(range(100, 100 + len(prompts)))
    for rid, prompt in zip(rids, prompts, strict=True):
        ids = np.asarray(prompt, dtype="<i4").tobytes()
        planner.add_request(rid, ids, NEW_TOKENS)
        executor.add_request(NewRequest(rid=rid, prompt_ids=ids, sampling=greedy()))
    in_flight: deque[StepTokens] = deque()
    aborted = 0
    while planner.num_running or planner.num_waiting or in_flight:
        engine.draft({r for r in rids if _known(planner, r)})
        plan = planner.plan()
        if plan is not None:
            in_flight.append(executor.execute(step_from_plan(plan)))
            verifying = [r for r in rids if _known(planner, r) and planner.request(r)["verifying"]]
            if verifying and aborted < 3:  # abort one mid-verify, and keep running the rest
                assert planner.abort(verifying[0])
                aborted += 1
        while in_flight and (plan is None or len(in_flight) > 1):
            result = in_flight.popleft()
            planner.report(result.step_id, result.rids, result.token_ids)
            planner.check_invariants()
            finishes = np.frombuffer(result.finish, dtype=np.uint8).tolist()
            for rid, finish in zip(
                np.frombuffer(result.rids, "<i8").tolist(), finishes, strict=True
            ):
                if finish != FINISH_NONE and _known(planner, rid):
                    planner.finish(rid)
    assert aborted == 3
    plan = planner.plan()  # hands the last ended requests to the worker as ``dropped``
    if plan is not None:
        result = executor.execute(step_from_plan(plan))
        planner.report(result.step_id, result.rids, result.token_ids)
    assert_kv_accounting_is_exact(engine)


def _known(planner, rid: int) -> bool:
    try:
        return planner.request(rid)["state"] in ("running", "waiting", "retracted")
    except KeyError:
        return False


# ------------------------------------------------------------------ grammars


@pytest.fixture(scope="module")
def smollm_vocab_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama over SmolLM2's vocabulary, whose tokenizer the grammars need."""
    directory = tmp_path_factory.mktemp("tiny-smollm-vocab")
    random_llama(49152, 512, 3, eos_token_id=2, pad_token_id=0).save_pretrained(directory)
    return directory


def grammar_engine(model: Path, policy: Policy | None, conts=None) -> OfflineEngine:
    tokenizer_file = str(
        model_files.tokenizer_dir(model_files.resolve_model(None)) / "tokenizer.json"
    )
    if policy is None:
        engine = OfflineEngine(str(model), block_size=BLOCK, num_blocks=256, check_invariants=True)
    else:
        engine = DraftingEngine(str(model), policy, conts, num_blocks=256, overlap=False)
    config = engine.runner.config
    grammars = GrammarMasks(lambda: tokenizer_file, config.vocab_size, config.eos_token_ids)
    engine.executor = StepExecutor(
        engine.runner, block_size=BLOCK, eos_token_ids=list(config.eos_token_ids),
        grammars=grammars,
    )  # fmt: skip
    return engine


def big_vocab_drafts(cont: list[int] | None, at: int, k: int, rng: random.Random) -> list[int]:
    """The true continuation, corrupted at one place, or random tokens (which the grammars
    forbid nearly always)."""
    choice = rng.randrange(3)
    drafts = list(cont[at : at + k]) if cont else []
    if choice == 2 or not drafts:
        return [rng.randrange(3, 49152) for _ in range(k)]
    if choice == 1:
        drafts[rng.randrange(len(drafts))] = rng.randrange(3, 49152)
    return drafts


def test_grammar_constrained_output_equals_plain_decoding(smollm_vocab_model: Path) -> None:
    prompts = [[1, 9690, 198, 20, 30, 40], [1, 2683, 314], [1, 77, 88, 99, 1000]]
    params = [
        SamplingParams(max_new_tokens=20, temperature=0.0, grammar=Grammar("json_object")),
        SamplingParams(max_new_tokens=20, temperature=0.0, grammar=Grammar("regex", "[0-9]{3,9}")),
        SamplingParams(
            max_new_tokens=20, temperature=0.7, seed=9, grammar=Grammar("regex", "(ab|cd)+x")
        ),
    ]
    plain = grammar_engine(smollm_vocab_model, None)
    want = plain.generate(prompts, params)
    assert want[1].finish_reason == "stop" and want[1].token_ids  # the regex completed
    conts = continuations(prompts, want)
    for seed in range(3):
        engine = grammar_engine(smollm_vocab_model, big_vocab_drafts, conts)
        engine.rng = random.Random(seed)
        got = engine.generate(prompts, params)
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert (g.token_ids, g.finish_reason) == (w.token_ids, w.finish_reason), (seed, i)
        assert engine.verify_entries > 0
        assert engine.emitted_by_verify > engine.verify_entries  # some drafts were accepted
        assert_kv_accounting_is_exact(engine)


# ------------------------------------------------------------------ the request table


def test_a_verify_entry_becomes_its_positions_and_logits_rows() -> None:
    """A Step of a plain decode, a prefill chunk that does not sample and a verify entry
    (2 drafts): input ids, positions, one logits row per position of the verify entry, the
    drafts by sampling entry."""
    table = RequestTable(block_size=4, eos_token_ids=[TINY_EOS])
    for rid in (1, 2, 3):
        table.add(NewRequest(rid=rid, prompt_ids=i32([5, 6, 7]), sampling=greedy()))
    table.get(1).last_token, table.get(1).block_table = 40, [0, 1]
    table.get(2).last_token, table.get(2).block_table = 50, [2]
    step = make_step(
        7,
        [
            dict(rid=2, start=3, n=1, decode=1),
            dict(rid=3, start=0, n=2, ids=[5, 6], blocks=[3], sample=0),
            dict(rid=1, start=5, n=3, decode=1, ids=[41, 42]),  # positions 5..7
        ],
    )
    prepared = table.prepare(step)
    batch = prepared.batch
    assert batch.input_ids.tolist() == [50, 5, 6, 40, 41, 42]
    assert batch.positions.tolist() == [3, 0, 1, 5, 6, 7]
    assert batch.sample_index.tolist() == [0, 3, 4, 5]
    assert [s.rid for s in prepared.sampling] == [2, 1]
    assert prepared.verify == {1: [41, 42]}


@pytest.mark.parametrize(
    "entry, message",
    [
        (dict(rid=1, start=5, n=3, decode=1, ids=[41]), "prefill input ids and drafts"),
        (dict(rid=1, start=5, n=3, decode=1, sample=0, ids=[41, 42]), "does not sample"),
    ],
)
def test_malformed_verify_entries_are_refused(entry: dict, message: str) -> None:
    table = RequestTable(block_size=4, eos_token_ids=[TINY_EOS])
    table.add(NewRequest(rid=1, prompt_ids=i32([5, 6, 7]), sampling=greedy()))
    table.get(1).last_token, table.get(1).block_table = 40, [0, 1]
    with pytest.raises(ValueError, match=message):
        table.prepare(make_step(0, [entry]))


def test_requests_without_logprobs_beside_ones_with_them(tiny_model: Path) -> None:
    """Logprobs travel one per reported token once any request asked; each request that asked
    gets its own, whatever the others and their verify entries emitted."""
    prompts = random_prompts(10)
    params = [greedy() if i % 2 else SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0,
              ignore_eos=True) for i in range(len(prompts))]  # fmt: skip
    want = plain_run(tiny_model, prompts, params)
    engine = DraftingEngine(str(tiny_model), mixed_drafts, continuations(prompts, want),
                            overlap=False)  # fmt: skip
    got = engine.generate(prompts, params)
    assert_same_outputs(got, want, "some with logprobs")
    assert all((o.logprobs is None) == (i % 2 == 0) for i, o in enumerate(got))


def test_the_offline_engine_runs_with_drafting_enabled_but_no_drafts(tiny_model: Path) -> None:
    prompts = random_prompts(11)
    want = plain_run(tiny_model, prompts, greedy())
    engine = OfflineEngine(str(tiny_model), block_size=BLOCK, num_blocks=512,
                           check_invariants=True, max_draft_tokens=K)  # fmt: skip
    assert_same_outputs(engine.generate(prompts, greedy()), want, "max_draft_tokens, no drafts")


# ------------------------------------------------------------------ chained entries (is_decode 3)


def chain_executor(model: Path, prompts: list[list[int]]) -> StepExecutor:
    """A real worker's executor (Steps are written by hand) with requests 1, 2, ... added."""
    executor = OfflineEngine(str(model), block_size=BLOCK, num_blocks=64).executor
    for rid, prompt in enumerate(prompts, start=1):
        executor.add_request(NewRequest(rid=rid, prompt_ids=i32(prompt), sampling=greedy()))
    return executor


def run_step(executor: StepExecutor, step_id: int, entries: list[dict]) -> dict[int, list[int]]:
    """Runs a Step of ``entries`` (as make_step takes them); the tokens reported, by rid."""
    result = executor.execute(make_step(step_id, entries))
    rids = np.frombuffer(result.rids, dtype="<i8").tolist()
    tokens = np.frombuffer(result.token_ids, dtype="<i4").tolist()
    reported: dict[int, list[int]] = {}
    for rid, token in zip(rids, tokens, strict=True):
        reported.setdefault(rid, []).append(token)
    return reported


def blocks_for(first: int, positions: int) -> list[int]:
    return list(range(first, first + -(-positions // BLOCK)))


def test_a_chained_entry_behind_a_verify_that_accepts_every_draft_runs_as_a_verify(
    tiny_model: Path,
) -> None:
    prompt = random_prompts(12)[2]
    want = plain_run(tiny_model, [prompt], greedy())[0].token_ids
    executor = chain_executor(tiny_model, [prompt])
    p, k = len(prompt), 3
    blocks = blocks_for(0, p + NEW_TOKENS)
    got = run_step(executor, 0, [dict(rid=1, n=p, ids=prompt, blocks=blocks)])[1]
    verify = dict(rid=1, start=p, n=1 + k, decode=1, ids=want[1 : 1 + k])  # the true drafts
    got += run_step(executor, 1, [verify])[1]
    assert len(got) == k + 2
    # planned before that verify was reported, as if it accepted all k drafts
    chained = dict(rid=1, start=p + 1 + k, n=3, decode=3, ids=want[k + 2 : k + 4])
    reported = run_step(executor, 2, [chained])[1]
    assert len(reported) == 3  # a verify of its 2 drafts, both accepted
    got += reported
    for step_id, position in enumerate(range(p + len(got) - 1, p + 12), start=3):
        got += run_step(executor, step_id, [dict(rid=1, start=position, decode=1)])[1]
    assert got == want[: len(got)]


def test_a_chained_entry_behind_a_verify_that_rejects_a_draft_decodes_one_token(
    tiny_model: Path,
) -> None:
    """Its drafts are skipped (the prefill behind it still reads its own ids), it runs at the
    request's last sampled token, and its block-table update applies as sent."""
    prompts = random_prompts(13)[1:3]
    want = [o.token_ids for o in plain_run(tiny_model, prompts, greedy())]
    executor = chain_executor(tiny_model, prompts)
    p, k = len(prompts[0]), 3
    first = blocks_for(0, p + 1 + k)  # what the verify needs; the chained entry brings more
    got = run_step(executor, 0, [dict(rid=1, n=p, ids=prompts[0], blocks=first)])
    drafts = [want[0][1], (want[0][2] + 1) % TINY_VOCAB, want[0][3]]  # the second is wrong
    got[1] += run_step(executor, 1, [dict(rid=1, start=p, n=1 + k, decode=1, ids=drafts)])[1]
    assert got[1] == want[0][:3]  # one draft accepted, then the model's token
    more = blocks_for(len(first), p + NEW_TOKENS - len(first) * BLOCK)
    chained = dict(rid=1, start=p + 1 + k, n=3, decode=3, ids=[7, 8], offset=len(first),
                   blocks=more)  # fmt: skip
    other = dict(rid=2, n=len(prompts[1]), ids=prompts[1], blocks=blocks_for(32, 40))
    reported = run_step(executor, 2, [chained, other])
    assert reported[1] == [want[0][3]]  # exactly one token, at position p + 2
    assert executor.requests.get(1).block_table == first + more
    got[1] += reported[1]
    got[2] = reported[2]
    for step_id in range(3, 12):
        decodes = [
            dict(rid=rid, start=len(prompt) + len(got[rid]) - 1, decode=1)
            for rid, prompt in enumerate(prompts, start=1)
        ]
        for rid, tokens in run_step(executor, step_id, decodes).items():
            got[rid] += tokens
    assert got[1] == want[0][: len(got[1])] and len(got[1]) == 13
    assert got[2] == want[1][: len(got[2])] and len(got[2]) == 10


def test_a_finished_requests_chained_entry_runs_and_reports_nothing(tiny_model: Path) -> None:
    prompt = random_prompts(14)[1]
    executor = chain_executor(tiny_model, [prompt])
    executor.requests.get(1).params = greedy(max_new_tokens=3)
    want = plain_run(tiny_model, [prompt], greedy())[0].token_ids
    p, k = len(prompt), 4
    blocks = blocks_for(0, p + NEW_TOKENS)
    run_step(executor, 0, [dict(rid=1, n=p, ids=prompt, blocks=blocks)])
    verify = dict(rid=1, start=p, n=1 + k, decode=1, ids=want[1 : 1 + k])
    assert run_step(executor, 1, [verify])[1] == want[1:3]  # the length finish cuts it
    assert executor.requests.get(1).finished
    chained = dict(rid=1, start=p + 1 + k, n=3, decode=3, ids=want[k + 1 : k + 3])
    assert run_step(executor, 2, [chained]) == {}


def chained_table() -> RequestTable:
    """Request 1 sampled its last token (41) at position 4, request 3 (50) at 3; request 2 is
    new."""
    table = RequestTable(block_size=4, eos_token_ids=[TINY_EOS])
    for rid, prompt in ((1, [5, 6, 7]), (2, [8, 9]), (3, [5, 6, 7])):
        table.add(NewRequest(rid=rid, prompt_ids=i32(prompt), sampling=greedy()))
    table.get(1).output_ids, table.get(1).last_token = [40, 41], 41
    table.get(1).block_table = [0, 1]
    table.get(3).output_ids, table.get(3).last_token = [50], 50
    table.get(3).block_table = [2, 3]
    return table


def test_chained_entries_become_the_entries_they_run_as() -> None:
    table = chained_table()
    step = make_step(
        5,
        [
            dict(rid=1, start=6, n=3, decode=3, ids=[90, 91], offset=2, blocks=[4]),  # behind
            dict(rid=2, start=0, n=2, ids=[8, 9], blocks=[5]),
            dict(rid=3, start=3, n=2, decode=3, ids=[60]),  # at its last token: a verify
        ],
    )
    prepared = table.prepare(step)
    batch = prepared.batch
    assert batch.input_ids.tolist() == [41, 8, 9, 50, 60]
    assert batch.positions.tolist() == [4, 0, 1, 3, 4]
    assert (batch.start_pos, batch.num_tokens) == ([4, 0, 3], [1, 2, 2])
    assert batch.sample_index.tolist() == [0, 2, 3, 4]
    assert [s.rid for s in prepared.sampling] == [1, 2, 3]
    assert prepared.verify == {2: [60]}
    assert table.get(1).block_table == [0, 1, 4]


@pytest.mark.parametrize(
    "entry, message",
    [
        (
            dict(rid=1, start=3, n=2, decode=3, ids=[90]),
            "chained entry for request 1 starts at 3, before its last sampled token at position 4",
        ),
        (dict(rid=1, start=4, n=1, decode=3, sample=0), "a chained entry that does not sample"),
        (dict(rid=1, start=4, n=3, decode=3, ids=[90]), "prefill input ids and drafts"),
        (dict(rid=1, start=4, n=1, decode=4), "is_decode 4"),
    ],
)
def test_malformed_chained_entries_are_refused(entry: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        chained_table().prepare(make_step(0, [entry]))


def test_a_finished_requests_chained_entry_never_raises() -> None:
    """Wherever it starts: its tokens are discarded."""
    for start in (3, 4, 6):
        table = chained_table()
        table.get(1).finished = True
        step = make_step(0, [dict(rid=1, start=start, n=2, decode=3, ids=[90])])
        assert table.prepare(step).batch.positions.tolist() == [start, start + 1]
