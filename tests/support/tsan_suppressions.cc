// ThreadSanitizer's suppressions for the KDA_TSAN build (README, "Thread safety"), compiled into every
// test program of that build (TSan asks for them at start-up), so that a run by hand gets them too. Each
// covers code TSan cannot see into, and was measured not to hide test_concurrency's deliberate race:
//   called_from_lib:libomp.so.5  clang's variant: libomp's own allocator and locks are not annotated
//     (Archer annotates OpenMP's synchronisation only), so its memset / free / pthread_mutex_* calls on
//     memory it recycles between teams are reported. This ignores libc calls made from inside libomp
//     only. Never `race:libomp`: every parallel region's frames pass through libomp, and that rule hides
//     the deliberate race.
//   race:libdnnl.so.2  oneDNN (uninstrumented) when several threads create their first matmul
//     primitives at once: a lock it allocates lazily, and the entries of its process-wide primitive cache
//     (none with ONEDNN_PRIMITIVE_CACHE_CAPACITY=0). Only reports with a frame inside libdnnl.
//   race:dnnl::primitive_desc_base::query_md  the same cache seen from the other side: a thread reads a
//     cached primitive descriptor's memory descriptor (dnnl.hpp's inline query, compiled into our code)
//     that oneDNN wrote, uninstrumented, on the thread that created it; the report then has no frame
//     inside libdnnl (seen once in a CI preview, in Linear::run's weights_desc()).
#if defined(__SANITIZE_THREAD__)
#define KDA_TSAN_BUILD 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define KDA_TSAN_BUILD 1
#endif
#endif

#if defined(KDA_TSAN_BUILD)
extern "C" const char* __tsan_default_suppressions() {
  return "called_from_lib:libomp.so.5\n"
         "race:libdnnl.so.2\n"
         "race:dnnl::primitive_desc_base::query_md\n";
}
#endif
