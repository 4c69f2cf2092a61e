// The sizes of a process's large allocations (LD_PRELOAD), for tests/integration/test_delta_path.py:
// a whole copy of a large buffer is an allocation of its size, whoever makes it (Python's bytes,
// torch's tensors, NumPy's arrays, a library's buffers). The process arms it through ctypes:
// dipaco_alloc_arm(min) counts every allocation of at least `min` bytes from then on, in every
// thread, until dipaco_alloc_disarm(); dipaco_alloc_count() and dipaco_alloc_size(i) read them.
// realloc counts when it moves (or makes) a block; mmap counts an anonymous mapping (a buffer
// received into, say: glibc's malloc maps its large blocks through an internal call, not this). dlsym's own early allocations come from a
// static bump buffer.
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdlib.h>
#include <string.h>
#include <stdatomic.h>
#include <sys/mman.h>
#include <sys/types.h>

static void *(*real_malloc)(size_t);
static void *(*real_calloc)(size_t, size_t);
static void *(*real_realloc)(void *, size_t);
static int (*real_posix_memalign)(void **, size_t, size_t);
static void *(*real_aligned_alloc)(size_t, size_t);
static void (*real_free)(void *);
static void *(*real_mmap)(void *, size_t, int, int, int, off_t);
static void *(*real_mmap64)(void *, size_t, int, int, int, off_t);
static char boot[65536];
static size_t boot_used;
static atomic_long counted, counted_bytes;
static size_t sizes[4096];
static atomic_int armed;
static size_t min_size = (size_t)-1;
static __thread int inside;

static void init(void) {
    if (real_malloc || inside) return;
    inside = 1;
    real_malloc = dlsym(RTLD_NEXT, "malloc");
    real_calloc = dlsym(RTLD_NEXT, "calloc");
    real_realloc = dlsym(RTLD_NEXT, "realloc");
    real_posix_memalign = dlsym(RTLD_NEXT, "posix_memalign");
    real_aligned_alloc = dlsym(RTLD_NEXT, "aligned_alloc");
    real_free = dlsym(RTLD_NEXT, "free");
    real_mmap = dlsym(RTLD_NEXT, "mmap");
    real_mmap64 = dlsym(RTLD_NEXT, "mmap64");
    inside = 0;
}

static void note(size_t size) {
    if (atomic_load(&armed) && size >= min_size) {
        long i = atomic_fetch_add(&counted, 1);
        if (i < 4096) sizes[i] = size;
        atomic_fetch_add(&counted_bytes, (long)size);
    }
}

// Called through ctypes: start counting allocations of at least `size` bytes, from zero.
void dipaco_alloc_arm(size_t size) { min_size = size; counted = 0; counted_bytes = 0; armed = 1; }
void dipaco_alloc_disarm(void) { armed = 0; }
long dipaco_alloc_count(void) { return counted; }
long dipaco_alloc_bytes(void) { return counted_bytes; }
size_t dipaco_alloc_size(long i) { return i < 4096 ? sizes[i] : 0; }

void *malloc(size_t size) {
    if (!real_malloc) {
        init();
        if (!real_malloc) {  // dlsym itself allocating: a bump allocator
            void *p = boot + boot_used;
            boot_used += (size + 15) & ~(size_t)15;
            return p;
        }
    }
    note(size);
    return real_malloc(size);
}

void *calloc(size_t n, size_t size) {
    if (!real_calloc) {
        init();
        if (!real_calloc) {
            void *p = boot + boot_used;
            boot_used += (n * size + 15) & ~(size_t)15;
            return p;  // static memory is zeroed
        }
    }
    note(n * size);
    return real_calloc(n, size);
}

void *realloc(void *ptr, size_t size) {
    init();
    void *out = real_realloc(ptr, size);
    if (out != ptr) note(size);  // moved (or new): its bytes were copied or allocated
    return out;
}

int posix_memalign(void **p, size_t align, size_t size) {
    init();
    note(size);
    return real_posix_memalign(p, align, size);
}

void *aligned_alloc(size_t align, size_t size) {
    init();
    note(size);
    return real_aligned_alloc(align, size);
}

void free(void *p) {
    if ((char *)p >= boot && (char *)p < boot + sizeof boot) return;
    init();
    real_free(p);
}

void *mmap(void *addr, size_t length, int prot, int flags, int fd, off_t offset) {
    init();
    if (flags & MAP_ANONYMOUS) note(length);
    return real_mmap(addr, length, prot, flags, fd, offset);
}

void *mmap64(void *addr, size_t length, int prot, int flags, int fd, off_t offset) {
    init();
    if (flags & MAP_ANONYMOUS) note(length);
    return real_mmap64(addr, length, prot, flags, fd, offset);
}
