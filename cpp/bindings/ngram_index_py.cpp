// Python classes NgramIndex and NgramCorpus and the function ngram_draft.
//
// append, add_sequence and both drafts run for every request every step once speculative
// decoding is on, so they are METH_FASTCALL methods (fastcall.h); the rest stays pybind11.
// Drafts are a handful of tokens, returned as a list of ints (cheaper than bytes to consume in
// Python at that size).
#include <memory>
#include <mutex>

#include "arrays.h"
#include "errors.h"
#include "fastcall.h"
#include "guarded.h"
#include "ngram_index.h"

namespace pyserve_bindings {

using pyserve::NgramCorpus;
using pyserve::NgramIndex;
using PyNgramIndex = Guarded<NgramIndex>;
using PyNgramCorpus = Guarded<NgramCorpus>;

namespace {

// Appends and corpus inserts this long release the GIL. Far fewer tokens than for
// RadixCache.insert: indexing costs max_ngram hash-table updates a token, far more than the
// tree's memcmp, so a few hundred tokens already outweigh a GIL hand-off.
constexpr size_t kReleaseGilTokens = 512;

// NgramIndex.append(tokens) -> None
PyObject* index_append(PyObject* self, PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames) {
  return fast_call([&]() -> PyObject* {
    PyObject* arg[1];
    parse_args("append", args, nargs, kwnames, {"tokens"}, arg);
    PyNgramIndex& g = self_object<PyNgramIndex>(self);
    Int32Arg t(arg[0], "tokens");
    g.maybe_released(t.size() >= kReleaseGilTokens,
                     [&](NgramIndex& x) { x.append(t.data(), t.size()); });
    Py_RETURN_NONE;
  });
}

// NgramIndex.draft(max_tokens, min_match, max_match) -> list[int]
PyObject* index_draft(PyObject* self, PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames) {
  return fast_call([&]() -> PyObject* {
    PyObject* arg[3];
    parse_args("draft", args, nargs, kwnames, {"max_tokens", "min_match", "max_match"}, arg);
    PyNgramIndex& g = self_object<PyNgramIndex>(self);
    const int64_t max_tokens = int_arg(arg[0]);
    const int64_t min_match = int_arg(arg[1]);
    const int64_t max_match = int_arg(arg[2]);
    auto d = g.held([&](NgramIndex& x) { return x.draft(max_tokens, min_match, max_match); });
    return to_list(d.tokens).release().ptr();
  });
}

// NgramCorpus.add_sequence(tokens) -> None
PyObject* corpus_add(PyObject* self, PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames) {
  return fast_call([&]() -> PyObject* {
    PyObject* arg[1];
    parse_args("add_sequence", args, nargs, kwnames, {"tokens"}, arg);
    PyNgramCorpus& g = self_object<PyNgramCorpus>(self);
    Int32Arg t(arg[0], "tokens");
    g.maybe_released(t.size() >= kReleaseGilTokens,
                     [&](NgramCorpus& x) { x.add_sequence(t.data(), t.size()); });
    Py_RETURN_NONE;
  });
}

// NgramCorpus.draft(context, max_tokens, min_match, max_match) -> list[int]
PyObject* corpus_draft(PyObject* self, PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames) {
  return fast_call([&]() -> PyObject* {
    PyObject* arg[4];
    parse_args("draft", args, nargs, kwnames, {"context", "max_tokens", "min_match", "max_match"},
               arg);
    PyNgramCorpus& g = self_object<PyNgramCorpus>(self);
    Int32Arg c(arg[0], "context");
    const int64_t max_tokens = int_arg(arg[1]);
    const int64_t min_match = int_arg(arg[2]);
    const int64_t max_match = int_arg(arg[3]);
    // A corpus is shared by every request: don't hold the GIL while another thread inserts.
    auto d = g.maybe_released(false, [&](NgramCorpus& x) {
      return x.draft(c.data(), c.size(), max_tokens, min_match, max_match);
    });
    return to_list(d.tokens).release().ptr();
  });
}

// "name($self, ...)\n--\n\n" gives the methods an inspect.signature, as pybind11's have.
PyMethodDef index_append_def = {
    "append", fastcall_function(&index_append), METH_FASTCALL | METH_KEYWORDS,
    "append($self, /, tokens)\n--\n\n"
    "appends token ids (a list or int32 buffer); ValueError, nothing appended, if one is out of "
    "range"};
PyMethodDef index_draft_def = {
    "draft", fastcall_function(&index_draft), METH_FASTCALL | METH_KEYWORDS,
    "draft($self, /, max_tokens, min_match, max_match)\n--\n\n"
    "the up to max_tokens tokens that followed the most recent earlier occurrence of the "
    "history's longest suffix of min_match..max_match tokens; [] if none"};
PyMethodDef corpus_add_def = {
    "add_sequence", fastcall_function(&corpus_add), METH_FASTCALL | METH_KEYWORDS,
    "add_sequence($self, /, tokens)\n--\n\n"
    "adds a completed sequence, evicting the oldest ones beyond token_budget"};
PyMethodDef corpus_draft_def = {
    "draft", fastcall_function(&corpus_draft), METH_FASTCALL | METH_KEYWORDS,
    "draft($self, /, context, max_tokens, min_match, max_match)\n--\n\n"
    "the up to max_tokens tokens that followed, in the same sequence, the most recent occurrence "
    "of context's longest suffix of min_match..max_match tokens; [] if none"};

}  // namespace

void bind_ngram(py::module_& m) {
  auto index =
      py::class_<PyNgramIndex>(
          m, "NgramIndex",
          "One request's token history, indexed by n-grams (n <= max_ngram) for prompt-lookup "
          "drafts.")
          .def(py::init([](int32_t max_ngram, int64_t vocab_size) {
                 return PyNgramIndex{std::make_shared<NgramIndex>(max_ngram, vocab_size),
                                     std::make_shared<std::mutex>()};
               }),
               py::arg("max_ngram"), py::arg("vocab_size") = 2147483647)
          .def_property_readonly(
              "max_ngram",
              [](PyNgramIndex& g) { return g.held([](auto& x) { return x.max_ngram(); }); })
          .def("__len__", [](PyNgramIndex& g) { return g.held([](auto& x) { return x.size(); }); });
  add_method(index, &index_append_def);
  add_method(index, &index_draft_def);

  auto corpus =
      py::class_<PyNgramCorpus>(m, "NgramCorpus",
                                "Completed token sequences under a token budget (oldest evicted "
                                "first), indexed by n-grams for drafts across requests.")
          .def(py::init([](int32_t max_ngram, int64_t token_budget, int64_t vocab_size) {
                 return PyNgramCorpus{
                     std::make_shared<NgramCorpus>(max_ngram, token_budget, vocab_size),
                     std::make_shared<std::mutex>()};
               }),
               py::arg("max_ngram"), py::arg("token_budget"), py::arg("vocab_size") = 2147483647)
          .def_property_readonly(
              "max_ngram",
              [](PyNgramCorpus& g) { return g.held([](auto& x) { return x.max_ngram(); }); })
          .def_property_readonly(
              "token_budget",
              [](PyNgramCorpus& g) { return g.held([](auto& x) { return x.token_budget(); }); })
          .def_property_readonly(
              "num_tokens",
              [](PyNgramCorpus& g) { return g.held([](auto& x) { return x.num_tokens(); }); })
          .def_property_readonly(
              "num_sequences",
              [](PyNgramCorpus& g) { return g.held([](auto& x) { return x.num_sequences(); }); })
          .def("clear", [](PyNgramCorpus& g) { g.released([](NgramCorpus& x) { x.clear(); }); });
  add_method(corpus, &corpus_add_def);
  add_method(corpus, &corpus_draft_def);

  m.def(
      "ngram_draft",
      [](PyNgramIndex& request, PyNgramCorpus* corpus, int64_t max_tokens, int64_t min_match,
         int64_t max_match) {
        // Always the request's lock first, then the corpus's: nothing else takes both.
        auto d = request.held([&](NgramIndex& r) {
          if (corpus == nullptr) {
            return pyserve::ngram_draft(r, nullptr, max_tokens, min_match, max_match);
          }
          std::lock_guard<std::mutex> lock(*corpus->mutex);
          return pyserve::ngram_draft(r, corpus->obj.get(), max_tokens, min_match, max_match);
        });
        return to_list(d.tokens);
      },
      py::arg("request"), py::arg("corpus").none(true), py::arg("max_tokens"), py::arg("min_match"),
      py::arg("max_match"),
      "draft from the request's own history and the corpus (None for none): the longer match "
      "wins, the request's on a tie");
}

}  // namespace pyserve_bindings
