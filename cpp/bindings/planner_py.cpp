// Python classes Planner and Step.
#include <pybind11/stl.h>

#include <string>

#include "arrays.h"
#include "errors.h"
#include "guarded.h"
#include "planner.h"

namespace pyserve_bindings {

using pyserve::BlockAllocator;
using pyserve::Planner;
using pyserve::PlannerConfig;
using pyserve::RadixCache;
using pyserve::Step;
using PyPlanner = Guarded<Planner>;

py::dict cache_stats_dict(const pyserve::CacheStats& s);  // radix_cache_py.cpp

namespace {

py::list step_entries(const Step& s) {
  py::list out;
  size_t input_at = 0;
  size_t block_at = 0;
  for (size_t i = 0; i < s.num_entries(); ++i) {
    py::dict e;
    e["rid"] = s.rids[i];
    e["start_pos"] = s.start_pos[i];
    e["num_tokens"] = s.num_tokens[i];
    // 2: the worker's draft model drafts; 3: chained behind the request's unreported verify
    e["is_decode"] = static_cast<int>(s.is_decode[i]);
    e["sample"] = static_cast<bool>(s.sample[i]);
    py::list inputs;  // a decode entry's are its drafts: all its positions but the first
    const int32_t num_inputs = s.is_decode[i] == 2   ? 0
                               : s.is_decode[i] != 0 ? s.num_tokens[i] - 1
                                                     : s.num_tokens[i];
    for (int32_t k = 0; k < num_inputs; ++k) inputs.append(s.input_ids[input_at++]);
    e["input_ids"] = inputs;
    e["block_offset"] = s.block_offsets[i];
    py::list blocks;
    for (int32_t k = 0; k < s.block_counts[i]; ++k) blocks.append(s.block_ids[block_at++]);
    e["block_ids"] = blocks;
    out.append(e);
  }
  return out;
}

void bind_step(py::module_& m) {
  py::class_<Step, std::shared_ptr<Step>>(m, "Step", "One forward pass (cpp/README.md, Step).")
      .def_readonly("step_id", &Step::step_id)
      .def_property_readonly("num_requests", [](const Step& s) { return s.num_entries(); })
      .def_property_readonly("rids", [](const Step& s) { return to_bytes(s.rids); })
      .def_property_readonly("start_pos", [](const Step& s) { return to_bytes(s.start_pos); })
      .def_property_readonly("num_tokens", [](const Step& s) { return to_bytes(s.num_tokens); })
      .def_property_readonly("is_decode", [](const Step& s) { return to_bytes(s.is_decode); })
      .def_property_readonly("sample", [](const Step& s) { return to_bytes(s.sample); })
      .def_property_readonly("input_ids", [](const Step& s) { return to_bytes(s.input_ids); })
      .def_property_readonly("block_offsets",
                             [](const Step& s) { return to_bytes(s.block_offsets); })
      .def_property_readonly("block_counts", [](const Step& s) { return to_bytes(s.block_counts); })
      .def_property_readonly("block_ids", [](const Step& s) { return to_bytes(s.block_ids); })
      .def_property_readonly("dropped", [](const Step& s) { return to_bytes(s.dropped); })
      .def_property_readonly("retracted", [](const Step& s) { return to_bytes(s.retracted); })
      .def_property_readonly("save_blocks", [](const Step& s) { return to_bytes(s.save_blocks); })
      .def_property_readonly("save_keys", [](const Step& s) { return to_bytes(s.save_keys); })
      .def_property_readonly("save_parents", [](const Step& s) { return to_bytes(s.save_parents); })
      .def_property_readonly("save_tokens", [](const Step& s) { return to_bytes(s.save_tokens); })
      .def_property_readonly("load_blocks", [](const Step& s) { return to_bytes(s.load_blocks); })
      .def_property_readonly("load_keys", [](const Step& s) { return to_bytes(s.load_keys); })
      .def_property_readonly("drop_keys", [](const Step& s) { return to_bytes(s.drop_keys); })
      .def_readonly("clear_disk", &Step::clear_disk)
      .def_readonly("num_prefill_tokens", &Step::num_prefill_tokens)
      .def_readonly("num_decode_tokens", &Step::num_decode_tokens)
      .def("entries", &step_entries, "one dict an entry, for tests and debugging")
      .def("__repr__", [](const Step& s) {
        return "<Step " + std::to_string(s.step_id) + ": " + std::to_string(s.num_entries()) +
               " entries, " + std::to_string(s.num_prefill_tokens) + " prefill + " +
               std::to_string(s.num_decode_tokens) + " decode tokens, " +
               std::to_string(s.dropped.size()) + " dropped, " +
               std::to_string(s.retracted.size()) + " retracted>";
      });
}

py::dict request_dict(const pyserve::RequestInfo& r) {
  py::dict d;
  d["state"] = r.state;
  d["prompt_len"] = r.prompt_len;
  d["output_len"] = r.output_len;
  d["num_computed"] = r.num_computed;
  d["num_scheduled"] = r.num_scheduled;
  d["cached_tokens"] = r.cached_tokens;
  d["max_new_tokens"] = r.max_new_tokens;
  d["priority"] = r.priority;
  d["tenant"] = r.tenant;
  d["planned_samples"] = r.planned_samples;
  d["num_blocks"] = r.num_blocks;
  d["inflight_steps"] = r.inflight_steps;
  d["draft_len"] = r.draft_len;
  d["verifying"] = r.verifying;
  d["spec_drafted"] = r.spec_drafted;
  d["spec_accepted"] = r.spec_accepted;
  d["output"] = to_list(r.output);
  return d;
}

py::dict stats_dict(const pyserve::PlannerStats& s) {
  py::dict d = cache_stats_dict(s.cache);
  d["num_waiting"] = s.num_waiting;
  d["num_running"] = s.num_running;
  d["num_free_blocks"] = s.num_free_blocks;
  d["num_inflight_steps"] = s.num_inflight_steps;
  d["num_requests"] = s.num_requests;
  d["retractions"] = s.retractions;
  d["fairness_retractions"] = s.fairness_retractions;
  d["steps_planned"] = s.steps_planned;
  py::dict tenants;
  for (const auto& [id, served] : s.tenant_tokens) tenants[py::int_(id)] = served;
  d["tenant_tokens"] = tenants;
  d["reserve_ratio"] = s.reserve_ratio;
  d["spec_verify_entries"] = s.spec_verify_entries;
  d["spec_chained_entries"] = s.spec_chained_entries;
  d["spec_chained_fallbacks"] = s.spec_chained_fallbacks;
  d["spec_draft_tokens"] = s.spec_draft_tokens;
  d["spec_accepted_tokens"] = s.spec_accepted_tokens;
  d["spec_accepted_histogram"] = s.spec_accepted_histogram;
  d["ngram_corpus_tokens"] = s.ngram_corpus_tokens;
  d["disk_loaded_blocks"] = s.disk_loaded_blocks;
  d["disk_failed_blocks"] = s.disk_failed_blocks;
  d["num_loading"] = s.num_loading;
  return d;
}

}  // namespace

void bind_planner(py::module_& m) {
  bind_step(m);
  py::class_<PyPlanner>(m, "Planner", "The scheduler: queues, admission, Steps (cpp/README.md).")
      .def(py::init([](int64_t num_blocks, int64_t block_size, int64_t max_running_requests,
                       int64_t max_prefill_tokens, int64_t chunked_prefill_size,
                       const std::string& policy, bool enable_radix_cache, int64_t vocab_size,
                       double init_reserve_ratio, double min_reserve_ratio, double reserve_decay,
                       int64_t max_draft_tokens, bool speculative_ngram, int64_t ngram_min_match,
                       int64_t ngram_max_match, int64_t ngram_corpus_tokens,
                       int64_t speculative_token_budget, bool speculative_draft_model,
                       bool tenant_fairness, int64_t fairness_quantum, int64_t disk_budget_blocks,
                       bool speculative_chain) {
             PlannerConfig c;
             c.num_blocks = num_blocks;
             c.block_size = block_size;
             c.max_running_requests = max_running_requests;
             c.max_prefill_tokens = max_prefill_tokens;
             c.chunked_prefill_size = chunked_prefill_size;
             c.policy = policy;
             c.enable_radix_cache = enable_radix_cache;
             c.vocab_size = vocab_size;
             c.init_reserve_ratio = init_reserve_ratio;
             c.min_reserve_ratio = min_reserve_ratio;
             c.reserve_decay = reserve_decay;
             c.max_draft_tokens = max_draft_tokens;
             c.speculative_ngram = speculative_ngram;
             c.ngram_min_match = ngram_min_match;
             c.ngram_max_match = ngram_max_match;
             c.ngram_corpus_tokens = ngram_corpus_tokens;
             c.speculative_token_budget = speculative_token_budget;
             c.speculative_draft_model = speculative_draft_model;
             c.tenant_fairness = tenant_fairness;
             c.fairness_quantum = fairness_quantum;
             c.disk_budget_blocks = disk_budget_blocks;
             c.speculative_chain = speculative_chain;
             return PyPlanner{std::make_shared<Planner>(c), std::make_shared<std::mutex>()};
           }),
           py::arg("num_blocks"), py::arg("block_size"), py::kw_only(),
           py::arg("max_running_requests") = 256, py::arg("max_prefill_tokens") = 8192,
           py::arg("chunked_prefill_size") = 2048, py::arg("policy") = "fcfs",
           py::arg("enable_radix_cache") = true, py::arg("vocab_size") = 2147483647,
           py::arg("init_reserve_ratio") = 0.7, py::arg("min_reserve_ratio") = 0.1,
           py::arg("reserve_decay") = 0.001, py::arg("max_draft_tokens") = 0,
           py::arg("speculative_ngram") = false, py::arg("ngram_min_match") = 2,
           py::arg("ngram_max_match") = 4, py::arg("ngram_corpus_tokens") = 0,
           py::arg("speculative_token_budget") = 16, py::arg("speculative_draft_model") = false,
           py::arg("tenant_fairness") = false, py::arg("fairness_quantum") = 4096,
           py::arg("disk_budget_blocks") = 0, py::arg("speculative_chain") = false)
      .def_property_readonly("cache",
                             [](PyPlanner& p) {
                               return Guarded<RadixCache>{
                                   std::shared_ptr<RadixCache>(p.obj, &p.obj->cache()), p.mutex};
                             })
      .def_property_readonly("allocator",
                             [](PyPlanner& p) {
                               return Guarded<BlockAllocator>{
                                   std::shared_ptr<BlockAllocator>(p.obj, &p.obj->allocator()),
                                   p.mutex};
                             })
      .def_property_readonly("block_size", [](PyPlanner& p) { return p.obj->config().block_size; })
      .def_property_readonly("num_blocks", [](PyPlanner& p) { return p.obj->config().num_blocks; })
      .def(
          "add_request",
          [](PyPlanner& p, int64_t rid, py::handle prompt, int64_t max_new_tokens,
             bool match_prefix, py::handle whole_spans, int64_t priority, int32_t tenant) {
            auto tokens = to_int32s(prompt, "prompt");
            auto spans = to_int32s(whole_spans, "whole_spans");
            p.released([&](Planner& x) {
              x.add_request(rid, std::move(tokens), max_new_tokens, match_prefix, std::move(spans),
                            priority, tenant);
            });
          },
          py::arg("rid"), py::arg("prompt"), py::arg("max_new_tokens"), py::kw_only(),
          py::arg("match_prefix") = true, py::arg("whole_spans") = py::bytes(),
          py::arg("priority") = 0, py::arg("tenant") = 0,
          "whole_spans: [start, end) pairs of prompt positions (int32 bytes or ints), ascending "
          "and disjoint, that no prefill chunk ends strictly inside; priority: lower runs first "
          "(the \"priority\" policy only); tenant: whose request, >= 0, for tenant_fairness "
          "(nonzero needs it)")
      .def(
          "plan",
          [](PyPlanner& p) -> std::shared_ptr<Step> {
            auto step = p.released([](Planner& x) { return x.plan(); });
            if (!step) return nullptr;
            return std::make_shared<Step>(std::move(*step));
          },
          "the next Step, or None when there is nothing to compute and nothing to drop")
      .def(
          "set_draft",
          [](PyPlanner& p, int64_t rid, py::handle draft) {
            auto tokens = to_int32s(draft, "draft");
            p.held([&](Planner& x) { x.set_draft(rid, std::move(tokens)); });
          },
          py::arg("rid"), py::arg("draft"),
          "drafted tokens for the request's next decode entry to verify (empty: none)")
      .def(
          "set_decode_costs",
          [](PyPlanner& p, std::vector<double> ms_by_tokens, double verify_overhead_ms) {
            p.held([&](Planner& x) { x.set_decode_costs(ms_by_tokens, verify_overhead_ms); });
          },
          py::arg("ms_by_tokens"), py::arg("verify_overhead_ms") = 0.0,
          "milliseconds of a decode-only step by its token count (index 0 unused; <= 0: "
          "unmeasured), and the extra wall time of a verify entry; the planner's own drafts "
          "are then only as many as these costs say pay")
      .def(
          "report",
          [](PyPlanner& p, int64_t step_id, py::handle rids, py::handle tokens) {
            Int64Arg r(rids, "rids");
            Int32Arg t(tokens, "tokens");
            p.released(
                [&](Planner& x) { x.report(step_id, r.data(), r.size(), t.data(), t.size()); });
          },
          py::arg("step_id"), py::arg("rids"), py::arg("tokens"))
      // With n-gram drafts an ended sequence is indexed into the corpus: not always short.
      .def(
          "finish",
          [](PyPlanner& p, int64_t rid) {
            auto run = [rid](Planner& x) { x.finish(rid); };
            p.obj->config().speculative_ngram ? p.released(run) : p.held(run);
          },
          py::arg("rid"))
      .def(
          "abort",
          [](PyPlanner& p, int64_t rid) {
            auto run = [rid](Planner& x) { return x.abort(rid); };
            return p.obj->config().speculative_ngram ? p.released(run) : p.held(run);
          },
          py::arg("rid"))
      .def(
          "fail_loads",
          [](PyPlanner& p, int64_t step_id, py::handle blocks) {
            auto ids = to_int32s(blocks, "blocks");
            p.held([&](Planner& x) { x.fail_loads(step_id, ids); });
          },
          py::arg("step_id"), py::arg("blocks"),
          "the blocks (int32 bytes or ints) of the oldest unreported step's loads that failed; "
          "before its report")
      .def("spill_to_disk",
           [](PyPlanner& p) { return p.released([](Planner& x) { return x.spill_to_disk(); }); })
      .def(
          "drop_disk_files",
          [](PyPlanner& p, std::vector<uint64_t> keys) {
            p.held([&](Planner& x) { x.drop_disk_files(keys); });
          },
          py::arg("keys"), "queues drops (for the next step) of block files the tree lacks")
      .def("flush_cache",
           [](PyPlanner& p) { return p.released([](Planner& x) { return x.flush_cache(); }); })
      .def_property_readonly(
          "num_waiting",
          [](PyPlanner& p) { return p.held([](auto& x) { return x.num_waiting(); }); })
      .def_property_readonly(
          "num_running",
          [](PyPlanner& p) { return p.held([](auto& x) { return x.num_running(); }); })
      .def_property_readonly(
          "num_free_blocks",
          [](PyPlanner& p) { return p.held([](auto& x) { return x.num_free_blocks(); }); })
      .def_property_readonly(
          "num_inflight_steps",
          [](PyPlanner& p) { return p.held([](auto& x) { return x.num_inflight_steps(); }); })
      .def("stats",
           [](PyPlanner& p) { return stats_dict(p.held([](auto& x) { return x.stats(); })); })
      .def(
          "request",
          [](PyPlanner& p, int64_t rid) {
            return request_dict(p.held([rid](Planner& x) { return x.request(rid); }));
          },
          py::arg("rid"))
      .def("block_states",
           [](PyPlanner& p) { return to_bytes(p.held([](auto& x) { return x.block_states(); })); })
      .def("refcounts",
           [](PyPlanner& p) { return to_bytes(p.held([](auto& x) { return x.refcounts(); })); })
      .def("check_invariants",
           [](PyPlanner& p) { p.released([](Planner& x) { x.check_invariants(); }); });
}

}  // namespace pyserve_bindings
