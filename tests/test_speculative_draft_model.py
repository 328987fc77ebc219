"""Speculative decoding with a draft model in the worker: worker-drafted verify entries
(``Step.is_decode == 2``) give exactly plain decoding's output.

The Steps come from a stand-in for the planner over a hand-managed block pool (HandPlanner),
run on an OfflineEngine's StepExecutor: each decoding request gets a worker-drafted verify entry
(``1 + k`` positions, no drafts in ``input_ids``); the worker's draft model writes the drafts,
and the report (the request's id once per emitted token) decides how many positions stand.

Three drafts over a tiny random-weight Llama target: the same checkpoint (agrees with the target,
so nearly every draft is accepted), the same with noise added to its weights (accepts some
drafts of an entry and rejects a later one), and another random model of the same vocabulary
(disagrees).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from tiny_models import random_llama
from worker_testlib import (  # noqa: F401 (an autouse fixture)
    TINY_EOS,
    TINY_VOCAB,
    assert_same_outputs,
    i32,
    make_step,
    make_tiny_llama,
    one_torch_thread,
    random_prompts,
)

from pyserve import model_files
from pyserve.wire.main_to_worker import Grammar, NewRequest, SamplingParams
from pyserve.wire.worker_to_detok import FINISH_LENGTH, FINISH_NONE, StepTokens
from pyserve.worker.batch import ForwardBatch
from pyserve.worker.executor import MalformedStep, StepExecutor
from pyserve.worker.grammar_masks import GrammarMasks
from pyserve.worker.offline import OfflineEngine, Output
from pyserve.worker.state import RequestTable

K = 4
BLOCK = 4
NEW_TOKENS = 20


class HandPlanner:
    """Stands in for the planner over a hand-managed block pool: a request holds blocks for all
    the positions it may reach (the requests after the first may share the first one's leading
    blocks: a prefix hit). Each step has, for each unfinished request, its prefill, or a
    worker-drafted verify entry of up to ``k`` drafts (a plain decode where none fits), or, at the
    steps ``retract`` names, a recompute of its prompt and output into new blocks (block offset
    0), as after retraction. Freed blocks are reused last in, first out, so a recompute gets its
    own old blocks back in reverse order: their stale K/V sit at other positions."""

    def __init__(self, engine: OfflineEngine, k: int = K) -> None:
        self.executor = engine.executor
        self.drafter = engine.drafter
        self.k = k
        self.verify_entries = 0
        self.recomputes = 0
        # verify entries that must catch the draft model up from position 0: a request's first
        # after its prefill or a recompute
        self.fresh_verify_entries = 0
        self._next_block = 0
        self._free: list[int] = []

    def _blocks(self, positions: int) -> list[int]:
        blocks = []
        for _ in range(-(-positions // BLOCK)):
            if self._free:
                blocks.append(self._free.pop())
            else:
                blocks.append(self._next_block)
                self._next_block += 1
        return blocks

    def _release(self, rid: int, tables: dict[int, list[int]], shared_prefix: int) -> None:
        if rid == 0 and shared_prefix:
            return  # its leading blocks stay shared
        own = tables.pop(rid)[shared_prefix // BLOCK if rid and shared_prefix else 0 :]
        self._free.extend(own)

    def run(
        self,
        prompts: list[list[int]],
        params: list[SamplingParams] | SamplingParams,
        *,
        shared_prefix: int = 0,
        retract: dict[int, set[int]] | None = None,
    ) -> list[Output]:
        """``shared_prefix``: the requests after the first reuse the first's blocks of that many
        leading tokens (whole blocks), prefilled a step after it; ``retract``: step -> rids."""
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        retract = retract or {}
        rids = list(range(len(prompts)))
        outputs = [Output(logprobs=[] if p.logprobs else None) for p in params]
        room = [
            len(q) + p.max_new_tokens + self.k + 1 for q, p in zip(prompts, params, strict=True)
        ]
        tables: dict[int, list[int]] = {}
        computed = dict.fromkeys(rids, -1)  # positions with target K/V; -1: not prefilled yet
        unfinished = set(rids)
        dropped: list[int] = []
        fresh = set(rids)
        for rid in rids:
            ids = i32(prompts[rid])
            self.executor.add_request(NewRequest(rid=rid, prompt_ids=ids, sampling=params[rid]))
        step_id = 0
        while unfinished:
            entries = []
            for rid in sorted(unfinished):
                prompt, out = prompts[rid], outputs[rid]
                if computed[rid] < 0:
                    if rid > 0 and shared_prefix and computed[0] < 0:
                        continue  # admitted once the first request's prefix is computed
                    entries.append(self._prefill(rid, prompt, room[rid], shared_prefix, tables))
                elif rid in retract.get(step_id, ()):
                    history = prompt + out.token_ids
                    self._release(rid, tables, shared_prefix)
                    tables[rid] = self._blocks(room[rid])
                    entries.append(dict(rid=rid, n=len(history), ids=history, blocks=tables[rid]))
                    self.recomputes += 1
                    fresh.add(rid)
                else:
                    k = min(self.k, params[rid].max_new_tokens - len(out.token_ids) - 1)
                    decode = 2 if k >= 1 else 1
                    entries.append(dict(rid=rid, start=computed[rid], n=1 + max(k, 0),
                                        decode=decode))  # fmt: skip
                    if decode == 2:
                        self.verify_entries += 1
                        self.fresh_verify_entries += rid in fresh
                        fresh.discard(rid)
            result = self.executor.execute(make_step(step_id, entries, dropped))
            step_id += 1
            dropped = []
            reported = _reported(result)
            for e in entries:  # a verify entry's positions stand as far as its tokens reported
                emitted = sum(r == e["rid"] for r, *_ in reported)
                computed[e["rid"]] = e.get("start", 0) + (emitted if e.get("decode") else e["n"])
            for rid, token, logprob, finish in reported:
                out = outputs[rid]
                out.token_ids.append(token)
                if out.logprobs is not None:
                    out.logprobs.append(logprob)
                if finish != FINISH_NONE:
                    out.finish_reason = "length" if finish == FINISH_LENGTH else "stop"
                    unfinished.discard(rid)
                    dropped.append(rid)
                    self._release(rid, tables, shared_prefix)
        self.executor.execute(make_step(step_id, [], dropped))
        assert len(self.executor.requests) == 0
        return outputs

    def _prefill(
        self, rid: int, prompt: list[int], room: int, shared: int, tables: dict[int, list[int]]
    ) -> dict:
        if rid == 0 or not shared:
            tables[rid] = self._blocks(room)
            return dict(rid=rid, n=len(prompt), ids=prompt, blocks=tables[rid])
        whole = shared // BLOCK  # only whole blocks are shared
        tables[rid] = tables[0][:whole] + self._blocks(room - whole * BLOCK)
        start = whole * BLOCK
        return dict(rid=rid, start=start, n=len(prompt) - start, ids=prompt[start:],
                    blocks=tables[rid])  # fmt: skip

    @property
    def acceptance(self) -> float:
        assert self.drafter is not None and self.drafter.drafted_tokens > 0
        return self.drafter.accepted_tokens / self.drafter.drafted_tokens


def _reported(result: StepTokens) -> list[tuple[int, int, float, int]]:
    rids = np.frombuffer(result.rids, dtype="<i8").tolist()
    tokens = np.frombuffer(result.token_ids, dtype="<i4").tolist()
    finishes = np.frombuffer(result.finish, dtype=np.uint8).tolist()
    logprobs = np.frombuffer(result.logprobs, dtype="<f4").tolist() if result.logprobs else None
    if logprobs is None:
        logprobs = [float("nan")] * len(rids)
    return list(zip(rids, tokens, logprobs, finishes, strict=True))


def draft_engine(
    target: Path, draft: Path | None, num_blocks: int = 1024, seed: int | None = None, **options
) -> OfflineEngine:
    return OfflineEngine(str(target), draft_model=str(draft) if draft else None,
                         block_size=BLOCK, num_blocks=num_blocks, seed=seed, **options)  # fmt: skip


# ------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("target"))


@pytest.fixture(scope="module")
def other_draft(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("other-draft"), seed=1)


@pytest.fixture(scope="module")
def noisy_draft(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The target's weights, each tensor with noise of 3% of its spread: about half the drafts
    are accepted."""
    model = random_llama(TINY_VOCAB, 512, 0, eos_token_id=TINY_EOS, pad_token_id=0)
    noise = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for weight in model.parameters():
            weight.add_(torch.randn(weight.shape, generator=noise) * 0.03 * weight.std())
    directory = tmp_path_factory.mktemp("noisy-draft")
    model.save_pretrained(directory)
    return directory


@pytest.fixture
def drafts(request: pytest.FixtureRequest, target: Path, noisy_draft: Path, other_draft: Path):
    return {"same": target, "noisy": noisy_draft, "other": other_draft}[request.param]


def prompts(seed: int) -> list[list[int]]:
    return random_prompts(seed, [3, 9, 14, 22, 31])


def greedy(**kw) -> SamplingParams:
    kw.setdefault("max_new_tokens", NEW_TOKENS)
    return SamplingParams(temperature=0.0, ignore_eos=True, logprobs=True, top_logprobs=2, **kw)


def plain_run(model: Path, prompts, params, **options) -> list[Output]:
    options.setdefault("num_blocks", 512)
    engine = OfflineEngine(str(model), block_size=BLOCK, check_invariants=True, **options)
    return engine.generate(prompts, params)


# ------------------------------------------------------------------ greedy


@pytest.mark.parametrize("drafts", ["same", "noisy", "other"], indirect=True)
def test_greedy_output_equals_plain_decoding(target: Path, drafts: Path) -> None:
    batch = prompts(1)
    want = plain_run(target, batch, greedy())
    planner = HandPlanner(draft_engine(target, drafts))
    got = planner.run(batch, greedy())
    assert_same_outputs(got, want, f"draft {drafts.name}", top_logprobs=False)
    assert planner.verify_entries > 0
    if drafts == target:  # the same model proposes the target's own argmax
        assert planner.acceptance > 0.8, planner.acceptance
    elif drafts.name.startswith("noisy"):
        assert 0.2 < planner.acceptance < 0.8, planner.acceptance
    else:  # another random model disagrees
        assert planner.acceptance < 0.2, planner.acceptance


def test_requests_sharing_prefix_blocks_catch_up_from_position_0(
    target: Path, noisy_draft: Path
) -> None:
    """The later requests reuse the first one's prefix blocks (target K/V computed once) and
    each catches the draft model up from position 0, rewriting the shared blocks' draft K/V with
    the values every sharer writes, while the first request keeps verifying."""
    batch = random_prompts(2, [3, 9, 14, 22, 31], shared_prefix=12)
    want = plain_run(target, batch, greedy())
    for draft in (target, noisy_draft):
        engine = draft_engine(target, draft)
        from_zero = recording_catch_ups_from_zero(engine)
        planner = HandPlanner(engine)
        got = planner.run(batch, greedy(), shared_prefix=12)
        assert_same_outputs(got, want, f"shared prefix, draft {draft.name}", top_logprobs=False)
        assert planner.verify_entries > 0
        assert sorted(from_zero) == list(range(len(batch)))


def test_a_table_replacement_resets_catch_up_and_output_stays_plain(
    target: Path, noisy_draft: Path
) -> None:
    """Recomputes into new blocks (block offset 0), as after retraction, at several steps: the
    draft model's positions start again from 0, and the output is plain decoding's."""
    batch = prompts(3)
    want = plain_run(target, batch, greedy())
    retract = {2: {0, 3}, 4: {1}, 5: {0, 2, 4}, 9: {3}}
    for draft in (target, noisy_draft):
        engine = draft_engine(target, draft)
        planner = HandPlanner(engine)
        assert engine.drafter is not None
        from_zero = recording_catch_ups_from_zero(engine)
        got = planner.run(batch, greedy(), retract=retract)
        assert_same_outputs(got, want, f"recompute, draft {draft.name}", top_logprobs=False)
        assert planner.recomputes >= 4
        # each request caught up from 0 after its prefill, and again after each recompute only
        assert len(from_zero) == planner.fresh_verify_entries > len(batch)
        if draft == target:
            assert planner.acceptance > 0.8, planner.acceptance


def test_long_catch_ups_run_in_several_passes(target: Path, noisy_draft: Path) -> None:
    batch = random_prompts(2, [3, 9, 14, 22, 31], shared_prefix=12)
    want = plain_run(target, batch, greedy())
    engine = draft_engine(target, noisy_draft)
    assert engine.drafter is not None
    engine.drafter.max_catch_up_tokens = 7
    runner = engine.drafter.runner
    forward = runner.forward
    sizes: list[int] = []

    def recording(batch, forward=forward, sizes=sizes):
        sizes.append(sum(batch.num_tokens))
        return forward(batch)

    runner.forward = recording
    planner = HandPlanner(engine)
    got = planner.run(batch, greedy(), shared_prefix=12)
    assert_same_outputs(got, want, "catch-ups of 7 tokens", top_logprobs=False)
    assert max(sizes) == 7 and 0.2 < planner.acceptance < 0.8


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_greedy_on_other_backends(target: Path, noisy_draft: Path, backend: str) -> None:
    """The torch reference and the triton backend (in its interpreter here, conftest.py)."""
    batch = prompts(9)[:3]
    params = greedy(max_new_tokens=10)
    want = plain_run(target, batch, params, backend=backend)
    planner = HandPlanner(draft_engine(target, noisy_draft, backend=backend))
    assert_same_outputs(planner.run(batch, params), want, backend, top_logprobs=False)
    assert planner.verify_entries > 0 and planner.drafter.accepted_tokens > 0


def recording_catch_ups_from_zero(engine: OfflineEngine) -> list[int]:
    """The rids whose catch-up starts at position 0, one a verify entry, as the engine runs."""
    drafter = engine.drafter
    assert drafter is not None
    propose = drafter.propose
    from_zero: list[int] = []

    def recording(slots, grammars=None):
        from_zero.extend(s.state.rid for s in slots if s.state.draft_computed == 0)
        return propose(slots, grammars)

    drafter.propose = recording
    return from_zero


@pytest.mark.parametrize("max_new_tokens", [1, 2, 6])
def test_max_new_tokens_and_stop_tokens_cut_accepted_runs(
    target: Path, max_new_tokens: int
) -> None:
    batch = prompts(4)
    full = plain_run(target, batch, greedy())
    got = HandPlanner(draft_engine(target, target)).run(
        batch, greedy(max_new_tokens=max_new_tokens)
    )
    for out, f in zip(got, full, strict=True):
        assert out.token_ids == f.token_ids[:max_new_tokens]
        assert out.finish_reason == "length"
    # a stop token first seen at place 6..8, inside an accepted run
    params = []
    for out in full:
        place = next((t for t in range(6, 9) if out.token_ids[t] not in out.token_ids[:t]), None)
        assert place is not None
        params.append(greedy(stop_token_ids=[out.token_ids[place]]))
    want = plain_run(target, batch, params)
    got = HandPlanner(draft_engine(target, target)).run(batch, params)
    assert_same_outputs(got, want, "stop token", top_logprobs=False)
    assert all(o.finish_reason == "stop" for o in got)


# ------------------------------------------------------------------ sampling


def sampled(seed: int | None, **kw) -> SamplingParams:
    base = dict(max_new_tokens=NEW_TOKENS, temperature=0.8, seed=seed, ignore_eos=True)
    return SamplingParams(**{**base, **kw})


SAMPLED = [
    sampled(1),
    sampled(2, top_p=0.9, top_k=20, min_p=0.05),
    sampled(3, repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.2),
    sampled(4, logit_bias={7: 5.0, 11: -100.0}, logprobs=True, top_logprobs=2),
    sampled(5, min_tokens=6, ignore_eos=False, temperature=1.2),
]


@pytest.mark.parametrize("drafts", ["same", "noisy", "other"], indirect=True)
def test_seeded_sampling_is_reproducible(target: Path, drafts: Path) -> None:
    batch = prompts(5)
    runs = []
    for _ in range(2):
        planner = HandPlanner(draft_engine(target, drafts))
        runs.append(planner.run(batch, SAMPLED))
        assert planner.verify_entries > 0
    for i, (a, b) in enumerate(zip(*runs, strict=True)):
        assert a.token_ids == b.token_ids, f"prompt {i}"
        assert a.finish_reason == b.finish_reason
        assert all(0 <= t < TINY_VOCAB for t in a.token_ids)
        if a.finish_reason == "length":
            assert len(a.token_ids) == NEW_TOKENS
        else:  # only the request that may stop at EOS, after its min_tokens
            assert i == 4 and a.finish_reason == "stop" and a.token_ids[-1] == TINY_EOS
            assert len(a.token_ids) > 6
    assert runs[0][3].logprobs is not None and len(runs[0][3].logprobs) == NEW_TOKENS


def test_a_seeded_requests_output_does_not_depend_on_its_neighbours(target: Path) -> None:
    batch = prompts(8)
    alone = HandPlanner(draft_engine(target, target)).run(batch[:1], SAMPLED[:1])
    together = HandPlanner(draft_engine(target, target)).run(batch, SAMPLED)
    assert alone[0].token_ids == together[0].token_ids


def test_the_same_checkpoint_accepts_nearly_every_sampled_draft(target: Path) -> None:
    """q equals the target's p when the request only scales by temperature: min(1, p/q) = 1."""
    planner = HandPlanner(draft_engine(target, target))
    outputs = planner.run(prompts(6), [sampled(s, temperature=1.0) for s in range(5)])
    assert all(len(o.token_ids) == NEW_TOKENS for o in outputs)
    assert planner.acceptance > 0.8, planner.acceptance


def test_sampled_tokens_after_rejections_follow_the_targets_distribution(
    target: Path, noisy_draft: Path
) -> None:
    """One prompt, many unseeded requests at temperature 1.5 with a draft that is often rejected:
    the first token verified against the draft's q, given the token before it, is distributed as
    the target says (a chi-square test over the likely tokens, the rest lumped)."""
    prompt = random_prompts(12, [6])[0]
    n = 3000
    params = SamplingParams(max_new_tokens=3, temperature=1.5, ignore_eos=True)
    engine = draft_engine(target, noisy_draft, num_blocks=3 * n + 1, seed=7)
    planner = HandPlanner(engine, k=1)
    outputs = planner.run([prompt] * n, params)
    assert 0.2 < planner.acceptance < 0.9, planner.acceptance
    firsts = [o.token_ids[0] for o in outputs]
    given = max(set(firsts), key=firsts.count)
    seconds = [o.token_ids[1] for o in outputs if o.token_ids[0] == given]
    assert len(seconds) > 500
    whole = ForwardBatch.whole_prompt([*prompt, given], BLOCK)
    logits = engine.runner.forward(whole)[-1]
    p = torch.softmax(logits / 1.5, dim=-1).double()
    counts = torch.bincount(torch.tensor(seconds), minlength=TINY_VOCAB).double()
    expected = p * len(seconds)
    likely = expected >= 5
    observed = torch.cat([counts[likely], counts[~likely].sum()[None]])
    expect = torch.cat([expected[likely], expected[~likely].sum()[None]])
    chi2 = float(((observed - expect) ** 2 / expect).sum())
    df = len(observed) - 1
    assert chi2 < df + 5 * (2 * df) ** 0.5, (chi2, df)


def test_unseeded_sampling_beside_greedy(target: Path, other_draft: Path) -> None:
    batch = prompts(7)
    params = [sampled(None), greedy(), sampled(None, top_k=5), greedy(), sampled(9)]
    want = plain_run(target, batch, params)
    got = HandPlanner(draft_engine(target, other_draft)).run(batch, params)
    for i in (1, 3):  # the greedy requests are plain decoding's, whatever their neighbours
        assert_same_outputs([got[i]], [want[i]], f"greedy prompt {i}", top_logprobs=False)
    assert all(len(o.token_ids) == NEW_TOKENS for o in got)


# ------------------------------------------------------------------ grammars


@pytest.fixture(scope="module")
def smollm_vocab_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama over SmolLM2's vocabulary, whose tokenizer the grammars need."""
    directory = tmp_path_factory.mktemp("tiny-smollm-vocab")
    random_llama(49152, 512, 3, eos_token_id=2, pad_token_id=0).save_pretrained(directory)
    return directory


def with_grammars(engine: OfflineEngine) -> OfflineEngine:
    tokenizer_file = str(
        model_files.tokenizer_dir(model_files.resolve_model(None)) / "tokenizer.json"
    )
    config = engine.runner.config
    grammars = GrammarMasks(lambda: tokenizer_file, config.vocab_size, config.eos_token_ids)
    engine.executor = StepExecutor(
        engine.runner, block_size=BLOCK, eos_token_ids=list(config.eos_token_ids),
        grammars=grammars, drafter=engine.drafter,
    )  # fmt: skip
    return engine


def test_grammar_constrained_output_equals_plain_decoding(smollm_vocab_model: Path) -> None:
    """Greedy and seeded constrained requests: a sampled one's drafts are verified as point
    masses (a grammar-forbidden draft is rejected before any test), so even its seeded output
    is plain decoding's."""
    prompts = [[1, 9690, 198, 20, 30, 40], [1, 2683, 314], [1, 77, 88, 99, 1000]]
    params = [
        SamplingParams(max_new_tokens=20, temperature=0.0, grammar=Grammar("json_object")),
        SamplingParams(max_new_tokens=20, temperature=0.0, grammar=Grammar("regex", "[0-9]{3,9}")),
        SamplingParams(
            max_new_tokens=20, temperature=0.7, seed=9, grammar=Grammar("regex", "(ab|cd)+x")
        ),
    ]
    plain = with_grammars(OfflineEngine(str(smollm_vocab_model), block_size=BLOCK, num_blocks=256))
    want = plain.generate(prompts, params)
    assert want[1].finish_reason == "stop" and want[1].token_ids  # the regex completed
    engine = with_grammars(draft_engine(smollm_vocab_model, smollm_vocab_model, num_blocks=256))
    planner = HandPlanner(engine)
    got = planner.run(prompts, params)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert (g.token_ids, g.finish_reason) == (w.token_ids, w.finish_reason), i
    assert planner.verify_entries > 0 and planner.acceptance > 0.5


# ------------------------------------------------------------------ loading


def test_a_draft_with_another_vocabulary_is_refused(target: Path, tmp_path: Path) -> None:
    small = tmp_path / "small-vocab"
    random_llama(256, 512, 2, eos_token_id=TINY_EOS, pad_token_id=0).save_pretrained(small)
    with pytest.raises(ValueError, match="vocabulary") as error:
        OfflineEngine(str(target), draft_model=str(small), block_size=BLOCK, num_blocks=64)
    message = str(error.value)
    assert str(small) in message and str(target) in message and "\n" not in message


def test_a_draft_with_a_shorter_context_is_refused(target: Path, tmp_path: Path) -> None:
    short = tmp_path / "short-context"
    random_llama(TINY_VOCAB, 256, 2, eos_token_id=TINY_EOS, pad_token_id=0).save_pretrained(short)
    with pytest.raises(ValueError, match="positions") as error:
        OfflineEngine(str(target), draft_model=str(short), block_size=BLOCK, num_blocks=64)
    assert str(short) in str(error.value) and str(target) in str(error.value)
    # a target served at the draft's length loads
    engine = OfflineEngine(str(target), draft_model=str(short), block_size=BLOCK, num_blocks=64,
                           max_model_len=256)  # fmt: skip
    assert engine.drafter is not None


def test_a_draft_model_with_tensor_parallelism_is_refused(target: Path) -> None:
    from pyserve.worker.process import WorkerConfig, _load
    from pyserve.worker.settings import WorkerSettings

    settings = WorkerSettings(model=str(target), draft_model=str(target), block_size=BLOCK)
    config = WorkerConfig(in_addr="", out_addr="", settings=settings, tp_size=2)
    executor, error = _load(config, None)
    assert executor is None and error is not None
    assert "--tp 2" in error and str(target) in error and "\n" not in error


def test_the_worker_process_loads_a_draft_model(target: Path, noisy_draft: Path) -> None:
    from pyserve.worker.process import WorkerConfig, _load
    from pyserve.worker.settings import WorkerSettings

    settings = WorkerSettings(
        model=str(target), draft_model=str(noisy_draft), block_size=BLOCK, num_blocks=32
    )
    executor, error = _load(WorkerConfig(in_addr="", out_addr="", settings=settings), None)
    assert error is None and executor is not None and executor.drafter is not None
    assert executor.drafter.runner.num_blocks == 32


def test_the_draft_pool_has_the_targets_blocks(target: Path, other_draft: Path) -> None:
    engine = OfflineEngine(str(target), draft_model=str(other_draft), block_size=BLOCK,
                           num_blocks=40)  # fmt: skip
    assert engine.drafter is not None
    draft = engine.drafter.runner
    assert draft.num_blocks == engine.runner.num_blocks == 40
    assert draft.block_size == BLOCK


# ------------------------------------------------------------------ the request table


def table_with_requests() -> RequestTable:
    table = RequestTable(block_size=4, eos_token_ids=[TINY_EOS])
    for rid in (1, 2):
        table.add(NewRequest(rid=rid, prompt_ids=i32([5, 6, 7]), sampling=greedy()))
        state = table.get(rid)
        state.output_ids, state.last_token, state.block_table = [9, 10, 40], 40, [0, 1]
    return table


def test_a_worker_drafted_entry_has_no_ids_in_the_step() -> None:
    """A verify entry with drafts in the Step beside a worker-drafted one: the latter's draft
    slots wait for the draft model, and its verify drafts are placeholders."""
    table = table_with_requests()
    step = make_step(
        3,
        [
            dict(rid=1, start=5, n=3, decode=1, ids=[41, 42]),
            dict(rid=2, start=5, n=4, decode=2, blocks=[2], offset=2),  # positions 5..8
        ],
    )
    prepared = table.prepare(step)
    assert prepared.batch.input_ids.tolist() == [40, 41, 42, 40, 0, 0, 0]
    assert prepared.batch.positions.tolist() == [5, 6, 7, 5, 6, 7, 8]
    assert prepared.verify == {0: [41, 42], 1: [0, 0, 0]}
    [slot] = prepared.drafted
    assert (slot.entry, slot.state.rid, slot.start, slot.k, slot.at) == (1, 2, 5, 3, 4)


@pytest.mark.parametrize(
    "entry, message",
    [
        (dict(rid=1, start=5, n=3, decode=4), "is_decode 4"),
        (dict(rid=1, start=5, n=3, decode=2, ids=[41, 42]), "prefill input ids and drafts"),
        (dict(rid=1, start=5, n=3, decode=2, sample=0), "does not sample"),
    ],
)
def test_malformed_worker_drafted_entries_are_refused(entry: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        table_with_requests().prepare(make_step(0, [entry]))


def test_block_table_replacement_resets_the_draft_models_positions() -> None:
    table = table_with_requests()
    state = table.get(1)
    state.draft_computed = 6
    # new blocks appended after the table: what the draft model computed stays valid
    table.prepare(make_step(0, [dict(rid=1, start=5, n=1, decode=1, blocks=[7], offset=2)]))
    assert state.draft_computed == 6 and state.block_table == [0, 1, 7]
    # the table cut after its first block (a rolled-back verify's blocks, reallocated)
    table.prepare(make_step(1, [dict(rid=1, start=3, n=1, decode=1, blocks=[8], offset=1)]))
    assert state.draft_computed == 4
    # a recompute after retraction: offset 0 replaces the table
    state.output_ids = [9, 10]
    recompute = dict(rid=1, start=0, n=5, ids=[5, 6, 7, 9, 10], blocks=[3, 4], offset=0)
    table.prepare(make_step(2, [recompute]))
    assert state.draft_computed == 0 and state.block_table == [3, 4]


def test_a_worker_without_a_draft_model_refuses_worker_drafted_entries(target: Path) -> None:
    engine = OfflineEngine(str(target), block_size=BLOCK, num_blocks=16)
    executor: StepExecutor = engine.executor
    executor.add_request(NewRequest(rid=1, prompt_ids=i32([5, 6, 7]), sampling=greedy()))
    executor.execute(make_step(0, [dict(rid=1, n=3, ids=[5, 6, 7], blocks=[0, 1])]))
    with pytest.raises(MalformedStep, match="no draft model"):
        executor.execute(make_step(1, [dict(rid=1, start=3, n=3, decode=2)]))


def test_draft_catch_up_covers_the_whole_history_once(target: Path) -> None:
    """Hand-built Steps: a fresh request's first worker-drafted entry catches the draft model up
    over its prompt and output; after verification it holds the emitted tokens' positions."""
    engine = OfflineEngine(str(target), draft_model=str(target), block_size=BLOCK, num_blocks=16)
    executor = engine.executor
    prompt = [5, 6, 7, 8, 9]
    executor.add_request(NewRequest(rid=1, prompt_ids=i32(prompt), sampling=greedy()))
    executor.execute(make_step(0, [dict(rid=1, n=5, ids=prompt, blocks=[0, 1])]))
    state = executor.requests.get(1)
    assert state.draft_computed == 0 and len(state.output_ids) == 1
    tokens = executor.execute(make_step(1, [dict(rid=1, start=5, n=4, decode=2, blocks=[2],
                                                 offset=2)]))  # fmt: skip
    emitted = np.frombuffer(tokens.token_ids, dtype="<i4").tolist()
    assert 1 <= len(emitted) <= 4 and state.output_ids[1:] == emitted
    assert state.draft_computed == min(5 + 3, 5 + len(emitted))
    # finished here while the scheduler ran ahead: placeholder drafts, nothing reported
    state.finished = True
    start = 5 + len(emitted)
    tokens = executor.execute(make_step(2, [dict(rid=1, start=start, n=3, decode=2, blocks=[3],
                                                 offset=3)]))  # fmt: skip
    assert tokens.rids == b"" and len(state.output_ids) == 1 + len(emitted)
    assert torch.equal(state.prompt_ids, torch.tensor(prompt))
