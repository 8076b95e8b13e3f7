// The library's allocator setting (kda/common/allocator.h): building a state pool fixes glibc's mmap
// threshold, so a large block freed does not send every later one of its size to the heap; a threshold
// the process chose through the environment is left alone.
#include <gtest/gtest.h>
#include <sys/mman.h>

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "kda/common/allocator.h"
#include "kda/common/weight_buffer.h"
#include "kda/mem_cache/memory_pool.h"
#include "support/test_support.h"

#if defined(__GLIBC__)
#include <malloc.h>
#endif

namespace kda {
namespace {

#if defined(__GLIBC__)

// Blocks glibc currently serves from mappings of their own.
size_t mapped_blocks() { return mallinfo2().hblks; }

// Whether a block of `bytes` comes from a mapping of its own.
bool gets_own_mapping(size_t bytes) {
  const size_t before = mapped_blocks();
  void* volatile p = std::malloc(bytes);
  const bool mapped = mapped_blocks() > before;
  std::free(p);
  return mapped;
}

TEST(Allocator, BuildingAPoolKeepsLargeBlocksInTheirOwnMappings) {
  if (testing::kSanitizedMalloc) GTEST_SKIP() << "glibc's own malloc only, not a sanitizer's";
  if (std::getenv("MALLOC_MMAP_THRESHOLD_") || std::getenv("GLIBC_TUNABLES"))
    GTEST_SKIP() << "the environment sets malloc's own parameters";
  // A 4 MiB block freed: glibc's dynamic threshold (left as it is) would now be 4 MiB, and the next 512 KiB
  // block would come from the heap.
  void* volatile big = std::malloc(4 << 20);
  std::free(big);
  mem_cache::RecurrentStatePoolConfig c;
  c.layer_ids = {0};
  c.size = 1;
  c.num_heads = 1;
  c.head_k_dim = 4;
  c.head_v_dim = 4;
  c.conv_kernel = 2;
  c.conv_dim = 4;
  mem_cache::RecurrentStatePool pool(c);
  EXPECT_TRUE(gets_own_mapping(512 << 10));
  EXPECT_TRUE(gets_own_mapping(kMmapThreshold));
  // Freed, large blocks still go back to their own mappings: the threshold stays fixed.
  void* volatile again = std::malloc(4 << 20);
  std::free(again);
  EXPECT_TRUE(gets_own_mapping(512 << 10));
  EXPECT_TRUE(configure_allocator());  // in effect, and calling it again changes nothing
}

// A model load's scope serves blocks up to 16 MiB from the heap, scopes nest, and the outermost one's end
// puts the fixed threshold back.
TEST(Allocator, ALoadScopeServesLargeBlocksFromTheHeapUntilTheOutermostEnds) {
  if (testing::kSanitizedMalloc) GTEST_SKIP() << "glibc's own malloc only, not a sanitizer's";
  if (std::getenv("MALLOC_MMAP_THRESHOLD_") || std::getenv("GLIBC_TUNABLES"))
    GTEST_SKIP() << "the environment sets malloc's own parameters";
  ASSERT_TRUE(configure_allocator());
  ASSERT_TRUE(gets_own_mapping(8 << 20));
  {
    const LoadAllocatorScope outer;
    EXPECT_FALSE(gets_own_mapping(8 << 20));
    EXPECT_FALSE(gets_own_mapping(20 << 20));  // an expert's stacked gate and up at the real shapes
    EXPECT_TRUE(gets_own_mapping(48 << 20));   // above the scope's threshold
    {
      const LoadAllocatorScope inner;
      EXPECT_FALSE(gets_own_mapping(8 << 20));
    }
    EXPECT_FALSE(gets_own_mapping(8 << 20));  // the inner scope's end leaves the outer's setting
  }
  EXPECT_TRUE(gets_own_mapping(8 << 20));
  EXPECT_TRUE(gets_own_mapping(kMmapThreshold));
}

// In a fresh process (the death-test child re-runs only this test), a threshold set in the environment
// wins: configure_allocator leaves malloc alone and says so.
TEST(Allocator, AThresholdChosenInTheEnvironmentIsLeftAlone) {
  if (testing::kSanitizedMalloc) GTEST_SKIP() << "a sanitizer's allocator refuses mallopt";
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        setenv("MALLOC_MMAP_THRESHOLD_", "1048576", 1);
        std::exit(configure_allocator() ? 1 : 0);
      },
      ::testing::ExitedWithCode(0), "");
  EXPECT_EXIT(
      {
        setenv("GLIBC_TUNABLES", "glibc.malloc.mmap_threshold=1048576", 1);
        std::exit(configure_allocator() ? 1 : 0);
      },
      ::testing::ExitedWithCode(0), "");
  EXPECT_EXIT(std::exit(configure_allocator() ? 0 : 1), ::testing::ExitedWithCode(0), "");
}

#else

TEST(Allocator, BuildingAPoolKeepsLargeBlocksInTheirOwnMappings) { GTEST_SKIP() << "glibc's malloc only"; }

#endif

// The smaps field `field` of the mapping holding `p` ("" when none has it).
std::string smaps_field(const void* p, const std::string& field) {
  std::ifstream in("/proc/self/smaps");
  const auto a = reinterpret_cast<uintptr_t>(p);
  bool inside = false;
  for (std::string line; std::getline(in, line);) {
    uintptr_t lo = 0, hi = 0;
    char dash = 0;
    std::istringstream head(line);
    if (head >> std::hex >> lo >> dash >> hi && dash == '-' && line.find(':') > line.find(' ')) {
      inside = lo <= a && a < hi;
      continue;
    }
    if (inside && line.rfind(field + ":", 0) == 0) return line.substr(field.size() + 1);
  }
  return "";
}

bool thp_on() {
  std::ifstream thp("/sys/kernel/mm/transparent_hugepage/enabled");
  std::string mode((std::istreambuf_iterator<char>(thp)), std::istreambuf_iterator<char>());
  return !mode.empty() && mode.find("[never]") == std::string::npos;
}

// A weight buffer comes zeroed and is writable end to end, in memory the kernel may back with transparent
// huge pages (where THP is not switched off): under kPooledBytes cut from a shared chunk on 64 bytes, from
// it in a mapping of its own on a 2 MiB boundary, whole huge pages long.
TEST(Allocator, WeightBuffersAreZeroedAndEligibleForHugePages) {
  for (const size_t bytes : {size_t{1}, size_t{100}, kHugePageBytes - 1, kHugePageBytes,
                             5 * kHugePageBytes + 3, kPooledBytes - 1, kPooledBytes, kPooledBytes + 3}) {
    const WeightBuffer b = allocate_weights(bytes);
    ASSERT_NE(b.get(), nullptr) << bytes;
    const auto a = reinterpret_cast<uintptr_t>(b.get());
    const bool own = bytes >= kPooledBytes;
    EXPECT_EQ(a % (own ? kHugePageBytes : 64), 0u) << bytes;
    EXPECT_EQ(b.get_deleter().chunk == nullptr, own) << bytes;
    // A mapping of its own is whole huge pages: no last, partial 2 MiB left on 4 KiB pages.
    if (own) EXPECT_EQ(b.get_deleter().bytes % kHugePageBytes, 0u) << bytes;
    const auto* bytes_at = static_cast<const unsigned char*>(b.get());
    EXPECT_EQ(std::count(bytes_at, bytes_at + bytes, 0), static_cast<std::ptrdiff_t>(bytes))
        << bytes << ": not zeroed";
    std::memset(b.get(), 0x5A, bytes);
    EXPECT_EQ(static_cast<const unsigned char*>(b.get())[bytes - 1], 0x5A) << bytes;
    if (thp_on()) {
      const std::string eligible = smaps_field(b.get(), "THPeligible");
      ASSERT_FALSE(eligible.empty()) << "no THPeligible line in /proc/self/smaps";
      EXPECT_NE(eligible.find('1'), std::string::npos) << bytes << " bytes: THPeligible" << eligible;
    }
  }
}

// Blocks cut from a chunk follow one another without overlapping, each zeroed even where an earlier
// one was written and freed (a freed block's bytes are not handed out again), and the chunk goes back to
// the system with its last block.
TEST(Allocator, PooledWeightBuffersShareAChunkThatGoesBackWithItsLastBlock) {
  // Blocks until one starts a chunk of its own making (its first block sits at the chunk's base).
  std::vector<WeightBuffer> fill;
  fill.push_back(allocate_weights(kPooledBytes - 64));
  WeightChunk* const first = fill.back().get_deleter().chunk;
  while (fill.back().get_deleter().chunk == first) fill.push_back(allocate_weights(kPooledBytes - 64));
  WeightBuffer x = std::move(fill.back());
  fill.pop_back();
  fill.clear();
  const auto base = reinterpret_cast<uintptr_t>(x.get());
  ASSERT_EQ(base % kHugePageBytes, 0u);
  std::memset(x.get(), 0xA5, 1000);
  WeightBuffer y = allocate_weights(1000);
  ASSERT_EQ(y.get_deleter().chunk, x.get_deleter().chunk);
  const auto at_y = reinterpret_cast<uintptr_t>(y.get());
  ASSERT_GE(at_y, base + kPooledBytes - 64);  // right after x, or under ASan after x's poisoned gap
  EXPECT_LE(at_y - (base + kPooledBytes - 64), 64u);
  x.reset();
  WeightBuffer z = allocate_weights(100);
  ASSERT_EQ(z.get_deleter().chunk, y.get_deleter().chunk);
  EXPECT_GE(reinterpret_cast<uintptr_t>(z.get()), at_y + 1024);  // x's freed bytes are not handed out again
  const auto* zb = static_cast<const unsigned char*>(z.get());
  EXPECT_EQ(std::count(zb, zb + 100, 0), 100);
  unsigned char resident = 0;
  EXPECT_EQ(::mincore(reinterpret_cast<void*>(base), 4096, &resident), 0) << "the chunk went back early";
  y.reset();
  z.reset();
  errno = 0;
  EXPECT_EQ(::mincore(reinterpret_cast<void*>(base), 4096, &resident), -1);
  EXPECT_EQ(errno, ENOMEM) << "the chunk is still mapped after its last block was freed";
}

}  // namespace
}  // namespace kda
