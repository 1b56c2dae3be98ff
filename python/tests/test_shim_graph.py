"""The level-2 shim's CUDA graph pools (python/cuarena/torch_shim.cpp), without a GPU: built as in
test_shim_cap against the stand-in PyTorch and a stand-in libcuarena that logs its graph-pool
calls. PyTorch's hooks are called as torch.cuda.graph calls them: an allocation goes to
cuarena_graph_malloc exactly while a route is open and its filter accepts the stream, and to the
ordinary path otherwise; a begin whose retain fails throws and opens no route; a release never
throws (it runs in a graph's destructor); MemPool's createOrIncrefPool retains;
checkPoolLiveAllocations compares the pool's live blocks with the set it is given."""
import shutil
import tempfile
import unittest

from test_shim_cap import build_and_run
from test_torch_shim import CXX

_PROG = r"""
#include <torch/csrc/cuda/CUDAPluggableAllocator.h>
#include <cstdio>
#include <unordered_set>
extern "C" int cuarena_torch_install(char *err, size_t n);
extern "C" const char *stub_graph_log(void);
extern "C" void stub_graph_set(int retain_ok, size_t n, const uint64_t *blocks);
using namespace torch::cuda::CUDAPluggableAllocator;
template <class F> void call(const char *what, F f) {
    try { f(); }
    catch (c10::OutOfMemoryError &e) { std::printf("%s: OutOfMemoryError: %s\n", what, e.what()); return; }
    catch (c10::Error &e) { std::printf("%s: Error: %s\n", what, e.what()); return; }
    std::printf("%s: ok\n", what);
}
static cudaStream_t S(uintptr_t v) { return reinterpret_cast<cudaStream_t>(v); }
int main() {
    char err[256];
    if (cuarena_torch_install(err, sizeof err) != 0) { std::printf("install failed %s\n", err); return 1; }
    auto a = current_for_test();
    std::printf("hooks: %d %d %d\n", bool(a->begin_allocate_to_pool_fn_), bool(a->end_allocate_to_pool_fn_),
                bool(a->release_pool_fn_));
    const c10::cuda::MempoolId_t pool{3, 4};
    auto capturing = [](cudaStream_t s) { return s == S(0x77); };
    stub_graph_set(1, 0, nullptr);
    std::printf("before: %p\n", a->alloc_fn_(4242, 0, S(0x77)));
    a->begin_allocate_to_pool_fn_(0, pool, capturing);
    std::printf("routed: %p\n", a->alloc_fn_(4242, 0, S(0x77)));
    std::printf("other stream: %p\n", a->alloc_fn_(4242, 0, S(0x78)));
    std::printf("other device: %p\n", a->alloc_fn_(4242, 1, S(0x77)));
    call("routed failure", [&] { a->alloc_fn_(999, 0, S(0x77)); });
    a->end_allocate_to_pool_fn_(0, pool);
    std::printf("after: %p\n", a->alloc_fn_(4242, 0, S(0x77)));
    call("release", [&] { a->release_pool_fn_(0, pool); });
    std::printf("log: %s\n", stub_graph_log());
    stub_graph_set(0, 0, nullptr);
    call("begin refused", [&] { a->begin_allocate_to_pool_fn_(0, pool, capturing); });
    std::printf("not routed: %p\n", a->alloc_fn_(4242, 0, S(0x77)));
    stub_graph_set(1, 0, nullptr);
    call("mempool", [&] { a->createOrIncrefPool(2, c10::cuda::MempoolId_t{5, 6}); });
    std::printf("mempool log: %s\n", stub_graph_log());
    // What MemPool's constructor and destructor call besides.
    call("use_on_oom false", [&] { a->setUseOnOOM(2, c10::cuda::MempoolId_t{5, 6}, false); });
    call("use_on_oom true", [&] { a->setUseOnOOM(2, c10::cuda::MempoolId_t{5, 6}, true); });
    call("no_split", [&] { a->setNoSplit(2, c10::cuda::MempoolId_t{5, 6}); });
    call("own allocator", [&] {
        a->createOrIncrefPool(2, c10::cuda::MempoolId_t{7, 8},
                              std::shared_ptr<c10::cuda::CUDACachingAllocator::CUDAAllocator>(
                                  reinterpret_cast<c10::cuda::CUDACachingAllocator::CUDAAllocator *>(0x10), [](auto *) {}));
    });
    std::printf("use_count: %d\n", a->getPoolUseCount(2, c10::cuda::MempoolId_t{5, 6}));
    const uint64_t blocks[] = {0x1000, 0x2000};
    stub_graph_set(1, 2, blocks);
    void *b1 = reinterpret_cast<void *>(0x1000), *b2 = reinterpret_cast<void *>(0x2000), *b3 = reinterpret_cast<void *>(0x3000);
    std::printf("live same: %d\n", a->checkPoolLiveAllocations(0, pool, {b1, b2}));
    std::printf("live fewer: %d\n", a->checkPoolLiveAllocations(0, pool, {b1}));
    std::printf("live other: %d\n", a->checkPoolLiveAllocations(0, pool, {b1, b3}));
    return 0;
}
"""

# Checkpoints (torch.compile's reduce-overhead mode): the plug-in's bookkeeping of each block
# checkpointed is kept (the size asked, the stream) and put back by the restore; the restore
# tries again with room for every live block; the blocks it frees leave the bookkeeping; its
# blocks come back with the plug-in's own deleter; bad states and refusals throw.
_CHECKPOINT_PROG = r"""
#include <torch/csrc/cuda/CUDAPluggableAllocator.h>
#include <cstdio>
extern "C" int cuarena_torch_install(char *err, size_t n);
extern "C" const char *stub_graph_log(void);
extern "C" void stub_graph_set(int retain_ok, size_t n, const uint64_t *blocks);
using namespace torch::cuda::CUDAPluggableAllocator;
namespace cca = c10::cuda::CUDACachingAllocator;
template <class F> void call(const char *what, F f) {
    try { f(); }
    catch (c10::Error &e) { std::printf("%s: Error: %s\n", what, e.what()); return; }
    std::printf("%s: ok\n", what);
}
static void *P(uintptr_t v) { return reinterpret_cast<void *>(v); }
static void meta(const char *what, CUDAPluggableAllocator &a, uintptr_t p) {
    auto it = a.allocation_metadata_.find(P(p));
    if (it == a.allocation_metadata_.end()) { std::printf("%s: none\n", what); return; }
    std::printf("%s: %zu %d %p\n", what, it->second.size, int(it->second.device_idx), (void *)it->second.stream);
}
int main() {
    char err[256];
    if (cuarena_torch_install(err, sizeof err) != 0) { std::printf("install failed %s\n", err); return 1; }
    auto a = current_for_test();
    const c10::cuda::MempoolId_t pool{3, 4};
    const uint64_t two[] = {0x9000, 0x9200};
    stub_graph_set(1, 2, two);
    a->allocation_metadata_.emplace(P(0x9000), metadata_for_test(1000, 0, reinterpret_cast<cudaStream_t>(0x77)));
    a->allocation_metadata_.emplace(P(0x9200), metadata_for_test(600, 0, nullptr));
    std::shared_ptr<cca::AllocatorState> st;
    call("checkpoint", [&] { st = a->getCheckpointState(0, pool); });
    std::printf("checkpoint log: %s\n", stub_graph_log());
    // 20 blocks live now (more than the shim's first room), each in the bookkeeping.
    uint64_t twenty[20];
    for (int i = 0; i < 20; i++) {
        twenty[i] = 0xa000 + 512 * i;
        a->allocation_metadata_.emplace(P(twenty[i]), metadata_for_test(512, 0, nullptr));
    }
    a->allocation_metadata_.erase(P(0x9000));  // its tensor died since the checkpoint
    stub_graph_set(1, 20, twenty);
    call("restore", [&] {
        cca::CheckpointDelta d = a->setCheckpointPoolState(0, st);
        std::printf("freed: %zu %p %p\n", d.ptrs_freed.size(), d.ptrs_freed.front(), d.ptrs_freed.back());
        std::printf("made:");
        for (auto &p : d.dataptrs_allocd) std::printf(" %p %d %d", p.get(), p.get_deleter() == a->raw_deleter(), int(p.device().index));
        std::printf("\n");
    });
    std::printf("restore log: %s\n", stub_graph_log());
    meta("meta 9000", *a, 0x9000);
    meta("meta 9200", *a, 0x9200);
    meta("meta a000", *a, 0xa000);
    meta("meta a000+19", *a, 0xa000 + 512 * 19);
    call("wrong device", [&] { a->setCheckpointPoolState(1, st); });
    call("not cuarena's", [&] { a->setCheckpointPoolState(0, std::make_shared<cca::AllocatorState>()); });
    stub_graph_set(0, 0, nullptr);
    a->allocation_metadata_.emplace(P(0xb000), metadata_for_test(512, 0, nullptr));
    call("refused", [&] { a->setCheckpointPoolState(0, st); });
    meta("meta b000", *a, 0xb000);
    call("checkpoint refused", [&] { a->getCheckpointState(0, pool); });
    const uint64_t foreign[] = {0xd000};
    stub_graph_set(1, 1, foreign);
    call("checkpoint of a block not the plug-in's", [&] { a->getCheckpointState(0, pool); });
    stub_graph_set(1, 0, nullptr);
    st.reset();
    std::printf("drop log: %s\n", stub_graph_log());
    return 0;
}
"""


@unittest.skipIf(shutil.which(CXX) is None, "no C++ compiler")
class ShimGraph(unittest.TestCase):
    def test_routes_follow_begin_end_and_the_filter(self):
        d = tempfile.mkdtemp()
        try:
            r = dict(line.split(": ", 1) for line in build_and_run(d, _PROG).splitlines())
        finally:
            shutil.rmtree(d)
        self.assertEqual(r["hooks"], "1 1 1", r)
        self.assertEqual(r["before"], "0x4000", r)  # the ordinary path
        self.assertEqual(r["routed"], "0x5000", r)  # the graph pool
        self.assertEqual(r["other stream"], "0x4000", r)
        self.assertEqual(r["other device"], "0x4000", r)
        self.assertTrue(r["routed failure"].startswith("Error: cuarena: cannot allocate 999 bytes"), r)
        self.assertEqual(r["after"], "0x4000", r)
        self.assertEqual(r["release"], "ok", r)
        self.assertEqual(r["log"], "retain 3,4@0;begin@0;gmalloc 3,4 4242@0 s0x77;gmalloc 3,4 999@0 s0x77;end@0;"
                                   "release 3,4@0;", r)
        self.assertTrue(r["begin refused"].startswith("Error: cuarena: graph pool of CUDA device 0 unavailable"), r)
        self.assertEqual(r["not routed"], "0x4000", r)
        self.assertEqual(r["mempool"], "ok", r)
        self.assertEqual(r["mempool log"], "retain 5,6@2;", r)
        self.assertEqual(r["use_on_oom false"], "ok", r)
        self.assertTrue(r["use_on_oom true"].startswith("Error: cuarena: MemPool(use_on_oom=True) is not supported"), r)
        self.assertTrue(r["no_split"].startswith("Error: cuarena: MemPool(no_split=True) is not supported"), r)
        self.assertTrue(r["own allocator"].startswith("Error: cuarena: a torch.cuda.MemPool with an allocator"), r)
        self.assertEqual(r["use_count"], "2", r)
        self.assertEqual((r["live same"], r["live fewer"], r["live other"]), ("1", "0", "0"), r)

    def test_checkpoints_keep_the_plug_ins_bookkeeping_in_step(self):
        d = tempfile.mkdtemp()
        try:
            r = dict(line.split(": ", 1) for line in build_and_run(d, _CHECKPOINT_PROG).splitlines())
        finally:
            shutil.rmtree(d)
        self.assertEqual(r["checkpoint"], "ok", r)
        self.assertEqual(r["checkpoint log"], "checkpoint 3,4@0;", r)
        self.assertEqual(r["restore"], "ok", r)
        self.assertEqual(r["freed"], "20 0xa000 0xc600", r)
        self.assertEqual(r["made"], "0x9000 1 0 0x9200 1 0", r)
        self.assertEqual(r["restore log"], "restore room 16;restore room 36;", r)
        self.assertEqual(r["meta 9000"], "1000 0 0x77", r)  # as it was at the checkpoint
        self.assertEqual(r["meta 9200"], "600 0 (nil)", r)
        self.assertEqual((r["meta a000"], r["meta a000+19"]), ("none", "none"), r)
        self.assertTrue(r["wrong device"].startswith("Error: cuarena: setCheckpointPoolState: not a checkpoint"), r)
        self.assertTrue(r["not cuarena's"].startswith("Error: cuarena: setCheckpointPoolState: not a checkpoint"), r)
        self.assertTrue(r["refused"].startswith("Error: cuarena: graph pool restore of CUDA device 0 failed"), r)
        self.assertEqual(r["meta b000"], "512 0 (nil)", r)  # a refused restore changes nothing
        self.assertTrue(r["checkpoint refused"].startswith("Error: cuarena: graph pool checkpoint"), r)
        self.assertTrue(r["checkpoint of a block not the plug-in's"].startswith(
            "Error: cuarena: getCheckpointState: a live block of the graph pool was not allocated"), r)
        self.assertEqual(r["drop log"], "checkpoint freed;", r)


if __name__ == "__main__":
    unittest.main()
