/*
 * maru_pool._copyhash: copy bytes and compute their XXH3-64 (seed 0) in the same pass.
 *
 * Moving a KV chunk into or out of the pool used to be a copy followed by a hash of the same bytes:
 * two passes over memory, in Python, holding the GIL. Here every 64-byte stripe is loaded once, stored
 * to its destination and folded into the hash from the same registers, so the hash describes exactly
 * the bytes that were written, the source is read once, and the cost is that of the copy. The GIL is
 * released around the work.
 *
 * The result equals xxhash.xxh3_64_intdigest() of the bytes. Only the long-input algorithm (over 240
 * bytes, the only size a KV chunk has) is implemented here; shorter inputs are hashed by the xxhash
 * package, which is also the fallback when this module is missing and the reference the tests use.
 *
 * The best of AVX-512, AVX2 and SSE2 is chosen at import from what the CPU reports (the build never
 * uses -march=native: images run on other machines); AArch64 runs NEON, which every such CPU has;
 * elsewhere a portable scalar path runs.
 *
 * Built with the limited C API of Python 3.11, so one wheel serves every CPython from 3.11 on.
 */

#ifndef Py_LIMITED_API
#define Py_LIMITED_API 0x030B0000
#endif
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define COPYHASH_X86 1
#include <immintrin.h>
#endif

/* Advanced SIMD is part of every AArch64 CPU: no run-time check is needed for it. */
#if defined(__aarch64__) && defined(__ARM_NEON) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
#define COPYHASH_NEON 1
#include <arm_neon.h>
#endif

/* ------------------------------------------------------------------ XXH3 constants */

#define PRIME32_1 0x9E3779B1U
#define PRIME32_2 0x85EBCA77U
#define PRIME32_3 0xC2B2AE3DU
#define PRIME64_1 0x9E3779B185EBCA87ULL
#define PRIME64_2 0xC2B2AE3D27D4EB4FULL
#define PRIME64_3 0x165667B19E3779F9ULL
#define PRIME64_4 0x85EBCA77C2B2AE63ULL
#define PRIME64_5 0x27D4EB2F165667C5ULL
#define AVALANCHE_MUL 0x165667919E3779F9ULL

#define STRIPE 64
#define SECRET_SIZE 192
#define STRIPES_PER_BLOCK ((SECRET_SIZE - STRIPE) / 8) /* 16: a block is 1 KiB of input */
#define SCRAMBLE_SECRET (SECRET_SIZE - STRIPE)
#define LAST_STRIPE_SECRET (SECRET_SIZE - STRIPE - 7)
#define MERGE_SECRET 11
/* Up to this length XXH3 uses other algorithms; those inputs go to the xxhash package. */
#define SHORT_MAX 240

/* XXH3's default secret (XXH3_kSecret), a constant of the specification. */
static const uint8_t SECRET[SECRET_SIZE] = {
    0xb8, 0xfe, 0x6c, 0x39, 0x23, 0xa4, 0x4b, 0xbe, 0x7c, 0x01, 0x81, 0x2c, 0xf7, 0x21, 0xad, 0x1c,
    0xde, 0xd4, 0x6d, 0xe9, 0x83, 0x90, 0x97, 0xdb, 0x72, 0x40, 0xa4, 0xa4, 0xb7, 0xb3, 0x67, 0x1f,
    0xcb, 0x79, 0xe6, 0x4e, 0xcc, 0xc0, 0xe5, 0x78, 0x82, 0x5a, 0xd0, 0x7d, 0xcc, 0xff, 0x72, 0x21,
    0xb8, 0x08, 0x46, 0x74, 0xf7, 0x43, 0x24, 0x8e, 0xe0, 0x35, 0x90, 0xe6, 0x81, 0x3a, 0x26, 0x4c,
    0x3c, 0x28, 0x52, 0xbb, 0x91, 0xc3, 0x00, 0xcb, 0x88, 0xd0, 0x65, 0x8b, 0x1b, 0x53, 0x2e, 0xa3,
    0x71, 0x64, 0x48, 0x97, 0xa2, 0x0d, 0xf9, 0x4e, 0x38, 0x19, 0xef, 0x46, 0xa9, 0xde, 0xac, 0xd8,
    0xa8, 0xfa, 0x76, 0x3f, 0xe3, 0x9c, 0x34, 0x3f, 0xf9, 0xdc, 0xbb, 0xc7, 0xc7, 0x0b, 0x4f, 0x1d,
    0x8a, 0x51, 0xe0, 0x4b, 0xcd, 0xb4, 0x59, 0x31, 0xc8, 0x9f, 0x7e, 0xc9, 0xd9, 0x78, 0x73, 0x64,
    0xea, 0xc5, 0xac, 0x83, 0x34, 0xd3, 0xeb, 0xc3, 0xc5, 0x81, 0xa0, 0xff, 0xfa, 0x13, 0x63, 0xeb,
    0x17, 0x0d, 0xdd, 0x51, 0xb7, 0xf0, 0xda, 0x49, 0xd3, 0x16, 0x55, 0x26, 0x29, 0xd4, 0x68, 0x9e,
    0x2b, 0x16, 0xbe, 0x58, 0x7d, 0x47, 0xa1, 0xfc, 0x8f, 0xf8, 0xb8, 0xd1, 0x7a, 0xd0, 0x31, 0xce,
    0x45, 0xcb, 0x3a, 0x8f, 0x95, 0x16, 0x04, 0x28, 0xaf, 0xd7, 0xfb, 0xca, 0xbb, 0x4b, 0x40, 0x7e,
};

static inline uint64_t read64le(const uint8_t *p) {
    uint64_t v;
    memcpy(&v, p, sizeof v);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    v = __builtin_bswap64(v);
#endif
    return v;
}

static inline uint64_t mul128_fold64(uint64_t a, uint64_t b) {
#if defined(__SIZEOF_INT128__)
    unsigned __int128 p = (unsigned __int128)a * b;
    return (uint64_t)p ^ (uint64_t)(p >> 64);
#else
    uint64_t lo_lo = (a & 0xFFFFFFFFULL) * (b & 0xFFFFFFFFULL);
    uint64_t hi_lo = (a >> 32) * (b & 0xFFFFFFFFULL);
    uint64_t lo_hi = (a & 0xFFFFFFFFULL) * (b >> 32);
    uint64_t hi_hi = (a >> 32) * (b >> 32);
    uint64_t cross = (lo_lo >> 32) + (hi_lo & 0xFFFFFFFFULL) + lo_hi;
    uint64_t hi = (hi_lo >> 32) + (cross >> 32) + hi_hi;
    uint64_t lo = (cross << 32) | (lo_lo & 0xFFFFFFFFULL);
    return lo ^ hi;
#endif
}

/* ------------------------------------------------------------------ stripe kernels
 *
 * A kernel copies `n` stripes from `src` to `dst` (none when dst is NULL) and accumulates them,
 * starting at stripe `*in_block` of the current 1 KiB block and scrambling after each block's last
 * stripe. What it stores is what it hashed: both come from the same load.
 *
 * `nontemporal` (dst is then 64-byte aligned) stores around the cache, for copies into the pool: that
 * memory is read by other processes, not by this one, and a store that bypasses the cache need not
 * first read each destination line it overwrites. The stores are fenced before the kernel returns,
 * so they are visible before anything the caller does next (a commit).
 */

typedef void (*kernel_fn)(uint64_t acc[8], uint8_t *dst, const uint8_t *src, size_t n, unsigned *in_block,
                          int nontemporal);

static inline void accumulate_scalar(uint64_t acc[8], const uint8_t *in, const uint8_t *secret) {
    for (int j = 0; j < 8; j++) {
        uint64_t v = read64le(in + 8 * j);
        uint64_t k = v ^ read64le(secret + 8 * j);
        acc[j ^ 1] += v;
        acc[j] += (uint64_t)(uint32_t)k * (k >> 32);
    }
}

static inline void scramble_scalar(uint64_t acc[8]) {
    for (int j = 0; j < 8; j++) {
        uint64_t a = acc[j];
        a ^= a >> 47;
        a ^= read64le(SECRET + SCRAMBLE_SECRET + 8 * j);
        acc[j] = a * PRIME32_1;
    }
}

static void kernel_scalar(uint64_t acc[8], uint8_t *dst, const uint8_t *src, size_t n, unsigned *in_block,
                          int nontemporal) {
    unsigned s = *in_block;
    uint8_t stripe[STRIPE];
    while (n) {
        memcpy(stripe, src, STRIPE);
        if (dst) {
            memcpy(dst, stripe, STRIPE);
            dst += STRIPE;
        }
        accumulate_scalar(acc, stripe, SECRET + 8 * s);
        src += STRIPE;
        n--;
        if (++s == STRIPES_PER_BLOCK) {
            scramble_scalar(acc);
            s = 0;
        }
    }
    *in_block = s;
}

#ifdef COPYHASH_X86

/* One step per vector of lanes: acc[j^1] += v[j]; acc[j] += lo32(v[j]^key[j]) * hi32(v[j]^key[j]).
 * The 32-bit shuffle (1,0,3,2) swaps the two 64-bit lanes of each 128-bit half: the j^1 pairing. Both
 * terms are summed before they meet the accumulator, so a stripe adds one step, not two, to the chain
 * of dependent additions (addition mod 2^64 is associative: the result is the same). */
#define SWAP_LANES _MM_SHUFFLE(1, 0, 3, 2)

static inline __m128i round_sse2(__m128i acc, __m128i data, __m128i key) {
    __m128i keyed = _mm_xor_si128(data, key);
    __m128i product = _mm_mul_epu32(keyed, _mm_srli_epi64(keyed, 32));
    return _mm_add_epi64(acc, _mm_add_epi64(_mm_shuffle_epi32(data, SWAP_LANES), product));
}

static inline __m128i scramble_sse2(__m128i acc, __m128i key) {
    const __m128i prime = _mm_set1_epi32((int)PRIME32_1);
    acc = _mm_xor_si128(_mm_xor_si128(acc, _mm_srli_epi64(acc, 47)), key);
    __m128i lo = _mm_mul_epu32(acc, prime);
    __m128i hi = _mm_mul_epu32(_mm_srli_epi64(acc, 32), prime);
    return _mm_add_epi64(lo, _mm_slli_epi64(hi, 32));
}

static void kernel_sse2(uint64_t acc[8], uint8_t *dst, const uint8_t *src, size_t n, unsigned *in_block,
                        int nontemporal) {
    __m128i a[4];
    for (int i = 0; i < 4; i++) a[i] = _mm_loadu_si128((const __m128i *)(acc + 2 * i));
    unsigned s = *in_block;
    while (n) {
        size_t run = STRIPES_PER_BLOCK - s < n ? STRIPES_PER_BLOCK - s : n;
        const uint8_t *key = SECRET + 8 * s;
        for (size_t r = 0; r < run; r++, src += STRIPE, key += 8) {
            __m128i d[4];
            for (int i = 0; i < 4; i++) d[i] = _mm_loadu_si128((const __m128i *)(src + 16 * i));
            if (dst) {
                if (nontemporal)
                    for (int i = 0; i < 4; i++) _mm_stream_si128((__m128i *)(dst + 16 * i), d[i]);
                else
                    for (int i = 0; i < 4; i++) _mm_storeu_si128((__m128i *)(dst + 16 * i), d[i]);
                dst += STRIPE;
            }
            for (int i = 0; i < 4; i++) a[i] = round_sse2(a[i], d[i], _mm_loadu_si128((const __m128i *)(key + 16 * i)));
        }
        n -= run;
        s += (unsigned)run;
        if (s == STRIPES_PER_BLOCK) {
            for (int i = 0; i < 4; i++)
                a[i] = scramble_sse2(a[i], _mm_loadu_si128((const __m128i *)(SECRET + SCRAMBLE_SECRET + 16 * i)));
            s = 0;
        }
    }
    for (int i = 0; i < 4; i++) _mm_storeu_si128((__m128i *)(acc + 2 * i), a[i]);
    if (nontemporal) _mm_sfence();
    *in_block = s;
}

__attribute__((target("avx2"))) static inline __m256i round_avx2(__m256i acc, __m256i data, __m256i key) {
    __m256i keyed = _mm256_xor_si256(data, key);
    __m256i product = _mm256_mul_epu32(keyed, _mm256_srli_epi64(keyed, 32));
    return _mm256_add_epi64(acc, _mm256_add_epi64(_mm256_shuffle_epi32(data, SWAP_LANES), product));
}

__attribute__((target("avx2"))) static inline __m256i scramble_avx2(__m256i acc, __m256i key) {
    const __m256i prime = _mm256_set1_epi32((int)PRIME32_1);
    acc = _mm256_xor_si256(_mm256_xor_si256(acc, _mm256_srli_epi64(acc, 47)), key);
    __m256i lo = _mm256_mul_epu32(acc, prime);
    __m256i hi = _mm256_mul_epu32(_mm256_srli_epi64(acc, 32), prime);
    return _mm256_add_epi64(lo, _mm256_slli_epi64(hi, 32));
}

__attribute__((target("avx2"))) static void kernel_avx2(uint64_t acc[8], uint8_t *dst, const uint8_t *src, size_t n,
                                                        unsigned *in_block, int nontemporal) {
    __m256i a0 = _mm256_loadu_si256((const __m256i *)acc);
    __m256i a1 = _mm256_loadu_si256((const __m256i *)(acc + 4));
    unsigned s = *in_block;
    while (n) {
        size_t run = STRIPES_PER_BLOCK - s < n ? STRIPES_PER_BLOCK - s : n;
        const uint8_t *key = SECRET + 8 * s;
        for (size_t r = 0; r < run; r++, src += STRIPE, key += 8) {
            __m256i d0 = _mm256_loadu_si256((const __m256i *)src);
            __m256i d1 = _mm256_loadu_si256((const __m256i *)(src + 32));
            if (dst) {
                if (nontemporal) {
                    _mm256_stream_si256((__m256i *)dst, d0);
                    _mm256_stream_si256((__m256i *)(dst + 32), d1);
                } else {
                    _mm256_storeu_si256((__m256i *)dst, d0);
                    _mm256_storeu_si256((__m256i *)(dst + 32), d1);
                }
                dst += STRIPE;
            }
            a0 = round_avx2(a0, d0, _mm256_loadu_si256((const __m256i *)key));
            a1 = round_avx2(a1, d1, _mm256_loadu_si256((const __m256i *)(key + 32)));
        }
        n -= run;
        s += (unsigned)run;
        if (s == STRIPES_PER_BLOCK) {
            a0 = scramble_avx2(a0, _mm256_loadu_si256((const __m256i *)(SECRET + SCRAMBLE_SECRET)));
            a1 = scramble_avx2(a1, _mm256_loadu_si256((const __m256i *)(SECRET + SCRAMBLE_SECRET + 32)));
            s = 0;
        }
    }
    _mm256_storeu_si256((__m256i *)acc, a0);
    _mm256_storeu_si256((__m256i *)(acc + 4), a1);
    if (nontemporal) _mm_sfence();
    *in_block = s;
}

__attribute__((target("avx512f"))) static void kernel_avx512(uint64_t acc[8], uint8_t *dst, const uint8_t *src,
                                                             size_t n, unsigned *in_block, int nontemporal) {
    const __m512i prime = _mm512_set1_epi32((int)PRIME32_1);
    __m512i a = _mm512_loadu_si512(acc);
    unsigned s = *in_block;
    while (n) {
        size_t run = STRIPES_PER_BLOCK - s < n ? STRIPES_PER_BLOCK - s : n;
        const uint8_t *key = SECRET + 8 * s;
        for (size_t r = 0; r < run; r++, src += STRIPE, key += 8) {
            __m512i d = _mm512_loadu_si512(src);
            if (dst) {
                if (nontemporal)
                    _mm512_stream_si512((void *)dst, d);
                else
                    _mm512_storeu_si512(dst, d);
                dst += STRIPE;
            }
            __m512i keyed = _mm512_xor_si512(d, _mm512_loadu_si512(key));
            __m512i product = _mm512_mul_epu32(keyed, _mm512_srli_epi64(keyed, 32));
            a = _mm512_add_epi64(a, _mm512_add_epi64(_mm512_shuffle_epi32(d, (_MM_PERM_ENUM)SWAP_LANES), product));
        }
        n -= run;
        s += (unsigned)run;
        if (s == STRIPES_PER_BLOCK) {
            a = _mm512_xor_si512(_mm512_xor_si512(a, _mm512_srli_epi64(a, 47)),
                                 _mm512_loadu_si512(SECRET + SCRAMBLE_SECRET));
            __m512i lo = _mm512_mul_epu32(a, prime);
            __m512i hi = _mm512_mul_epu32(_mm512_srli_epi64(a, 32), prime);
            a = _mm512_add_epi64(lo, _mm512_slli_epi64(hi, 32));
            s = 0;
        }
    }
    _mm512_storeu_si512(acc, a);
    if (nontemporal) _mm_sfence();
    *in_block = s;
}

#endif /* COPYHASH_X86 */

#ifdef COPYHASH_NEON

/* The same step as round_sse2 on 128-bit NEON vectors: vextq swaps the two 64-bit lanes (the j^1
 * pairing), and vmull_u32 of the narrowed low and high halves is the 32x32->64 product. */
static inline uint64x2_t round_neon(uint64x2_t acc, uint64x2_t data, uint64x2_t key) {
    uint64x2_t keyed = veorq_u64(data, key);
    uint64x2_t product = vmull_u32(vmovn_u64(keyed), vshrn_n_u64(keyed, 32));
    return vaddq_u64(acc, vaddq_u64(vextq_u64(data, data, 1), product));
}

static inline uint64x2_t scramble_neon(uint64x2_t acc, uint64x2_t key) {
    const uint32x2_t prime = vdup_n_u32(PRIME32_1);
    acc = veorq_u64(veorq_u64(acc, vshrq_n_u64(acc, 47)), key);
    uint64x2_t lo = vmull_u32(vmovn_u64(acc), prime);
    uint64x2_t hi = vmull_u32(vshrn_n_u64(acc, 32), prime);
    return vaddq_u64(lo, vshlq_n_u64(hi, 32));
}

/* `nontemporal` is a hint only: AArch64's non-temporal pair store (STNP) still allocates on most cores,
 * so plain stores are used; the commit that follows a copy is a system call, which orders them. */
static void kernel_neon(uint64_t acc[8], uint8_t *dst, const uint8_t *src, size_t n, unsigned *in_block,
                        int nontemporal) {
    uint64x2_t a[4];
    for (int i = 0; i < 4; i++) a[i] = vld1q_u64(acc + 2 * i);
    unsigned s = *in_block;
    while (n) {
        size_t run = STRIPES_PER_BLOCK - s < n ? STRIPES_PER_BLOCK - s : n;
        const uint8_t *key = SECRET + 8 * s;
        for (size_t r = 0; r < run; r++, src += STRIPE, key += 8) {
            uint64x2_t d[4];
            for (int i = 0; i < 4; i++) d[i] = vreinterpretq_u64_u8(vld1q_u8(src + 16 * i));
            if (dst) {
                for (int i = 0; i < 4; i++) vst1q_u8(dst + 16 * i, vreinterpretq_u8_u64(d[i]));
                dst += STRIPE;
            }
            for (int i = 0; i < 4; i++) a[i] = round_neon(a[i], d[i], vreinterpretq_u64_u8(vld1q_u8(key + 16 * i)));
        }
        n -= run;
        s += (unsigned)run;
        if (s == STRIPES_PER_BLOCK) {
            for (int i = 0; i < 4; i++)
                a[i] = scramble_neon(a[i], vreinterpretq_u64_u8(vld1q_u8(SECRET + SCRAMBLE_SECRET + 16 * i)));
            s = 0;
        }
    }
    for (int i = 0; i < 4; i++) vst1q_u64(acc + 2 * i, a[i]);
    *in_block = s;
}

#endif /* COPYHASH_NEON */

typedef struct {
    const char *name;
    kernel_fn kernel;
} simd_path;

/* Best first. */
static const simd_path PATHS[] = {
#ifdef COPYHASH_X86
    {"avx512", kernel_avx512},
    {"avx2", kernel_avx2},
    {"sse2", kernel_sse2},
#endif
#ifdef COPYHASH_NEON
    {"neon", kernel_neon},
#endif
    {"scalar", kernel_scalar},
};
#define NPATHS (sizeof PATHS / sizeof PATHS[0])

static int path_supported(const simd_path *path) {
#ifdef COPYHASH_X86
    __builtin_cpu_init();
    if (path->kernel == kernel_avx512) return __builtin_cpu_supports("avx512f");
    if (path->kernel == kernel_avx2) return __builtin_cpu_supports("avx2");
#endif
    (void)path;
    return 1;
}

static const simd_path *active_path = &PATHS[NPATHS - 1];

/* ------------------------------------------------------------------ the stream
 *
 * The bytes of one hash may arrive in many pieces (the pages of a chunk). XXH3 treats the last 64
 * bytes specially, so the stream is told its total length up front: stripes that start before
 * (total-1) rounded down to a stripe are "normal", the rest (1 to 64 bytes) is the tail, and the
 * final stripe is the last 64 bytes of the whole stream. A stripe split across pieces is assembled in
 * `pending`, hashed there and copied out from there.
 */

typedef struct {
    uint64_t acc[8];
    size_t total;
    size_t normal;   /* stripes hashed the normal way: (total - 1) / 64 */
    size_t hashed;   /* normal stripes hashed so far */
    unsigned in_block;
    size_t npending; /* bytes in `pending`: of an unfinished stripe, or of the tail */
    uint8_t pending[STRIPE];
    uint8_t last[STRIPE]; /* the last normal stripe: the final stripe overlaps it */
    kernel_fn kernel;
    int nontemporal; /* store runs of whole blocks around the cache (see the kernels) */
} stream;

/* Runs shorter than this (and unaligned ones) use ordinary stores: the fence would cost more. */
#define NONTEMPORAL_MIN_STRIPES STRIPES_PER_BLOCK

static void stream_init(stream *st, size_t total, kernel_fn kernel, int nontemporal) {
    static const uint64_t init[8] = {PRIME32_3, PRIME64_1, PRIME64_2, PRIME64_3,
                                     PRIME64_4, PRIME32_2, PRIME64_5, PRIME32_1};
    memcpy(st->acc, init, sizeof init);
    st->total = total;
    st->normal = (total - 1) / STRIPE;
    st->hashed = 0;
    st->in_block = 0;
    st->npending = 0;
    st->kernel = kernel;
    st->nontemporal = nontemporal;
}

/* Feed the next `len` bytes of the stream from `src`, copying them to `dst` unless it is NULL. */
static void stream_feed(stream *st, uint8_t *dst, const uint8_t *src, size_t len) {
    while (len) {
        if (st->npending == 0 && st->hashed < st->normal && len >= STRIPE) {
            size_t n = len / STRIPE;
            size_t left = st->normal - st->hashed;
            int reaches_last = n >= left;
            if (reaches_last) n = left - 1;
            if (n) {
                int nt = st->nontemporal && dst && n >= NONTEMPORAL_MIN_STRIPES && ((uintptr_t)dst & 63) == 0;
                st->kernel(st->acc, dst, src, n, &st->in_block, nt);
                st->hashed += n;
                src += n * STRIPE;
                if (dst) dst += n * STRIPE;
                len -= n * STRIPE;
            }
            if (reaches_last) {
                /* Into `last` first, then out: the final stripe re-reads these very bytes. */
                st->kernel(st->acc, st->last, src, 1, &st->in_block, 0);
                st->hashed++;
                if (dst) {
                    memcpy(dst, st->last, STRIPE);
                    dst += STRIPE;
                }
                src += STRIPE;
                len -= STRIPE;
            }
            continue;
        }
        size_t take = STRIPE - st->npending;
        if (take > len) take = len;
        if (take == 0) break; /* more bytes than announced: callers check totals, so never */
        memcpy(st->pending + st->npending, src, take);
        if (dst) {
            memcpy(dst, st->pending + st->npending, take);
            dst += take;
        }
        st->npending += take;
        src += take;
        len -= take;
        if (st->npending == STRIPE && st->hashed < st->normal) {
            st->kernel(st->acc, NULL, st->pending, 1, &st->in_block, 0);
            if (++st->hashed == st->normal) memcpy(st->last, st->pending, STRIPE);
            st->npending = 0;
        }
    }
}

static uint64_t stream_digest(stream *st) {
    /* The tail is the last `npending` bytes; the final stripe ends with them. */
    uint8_t final[STRIPE];
    memcpy(final, st->last + st->npending, STRIPE - st->npending);
    memcpy(final + STRIPE - st->npending, st->pending, st->npending);
    accumulate_scalar(st->acc, final, SECRET + LAST_STRIPE_SECRET);
    uint64_t h = (uint64_t)st->total * PRIME64_1;
    for (int i = 0; i < 4; i++) {
        const uint8_t *key = SECRET + MERGE_SECRET + 16 * i;
        h += mul128_fold64(st->acc[2 * i] ^ read64le(key), st->acc[2 * i + 1] ^ read64le(key + 8));
    }
    h ^= h >> 37;
    h *= AVALANCHE_MUL;
    h ^= h >> 32;
    return h;
}

/* ------------------------------------------------------------------ Python glue */

static PyObject *xxh3_short; /* xxhash.xxh3_64_intdigest, for inputs of 240 bytes or fewer */

typedef struct {
    uint8_t *addr; /* NULL: no destination (hash only); never NULL for a source */
    size_t len;
} segment;

typedef enum { GATHER, SCATTER } direction;

static int get_buffer(PyObject *obj, Py_buffer *view, int writable, const char *fn, const char *what) {
    if (PyObject_GetBuffer(obj, view, writable ? PyBUF_WRITABLE : PyBUF_SIMPLE) == 0) return 0;
    if (writable && PyObject_GetBuffer(obj, view, PyBUF_SIMPLE) == 0) {
        int readonly = view->readonly;
        PyBuffer_Release(view);
        if (readonly) {
            PyErr_Format(PyExc_TypeError, "%s: %s is read-only; it must be a writable buffer", fn, what);
            return -1;
        }
    }
    PyErr_Clear();
    PyObject *type_name = PyType_GetName(Py_TYPE(obj));
    PyErr_Format(PyExc_TypeError, "%s: %s must be a contiguous buffer (bytes, bytearray, memoryview, mmap, numpy "
                 "array), got %S", fn, what, type_name ? type_name : Py_None);
    Py_XDECREF(type_name);
    return -1;
}

/* Parse `(address, length)` pairs; returns the number of segments or -1 with an exception set. */
static Py_ssize_t parse_segments(PyObject *seq, direction dir, const char *fn, segment **out, size_t *total) {
    Py_ssize_t n = PySequence_Size(seq);
    if (n < 0) {
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError, "%s: segments must be a sequence of (address, length) pairs", fn);
        return -1;
    }
    segment *segs = PyMem_Malloc((n ? (size_t)n : 1) * sizeof(segment));
    if (segs == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    size_t sum = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PySequence_GetItem(seq, i);
        PyObject *a = NULL, *l = NULL;
        Py_ssize_t addr = -1, len = -1;
        int ok = item != NULL && PySequence_Check(item) && PySequence_Size(item) == 2;
        if (ok) {
            a = PySequence_GetItem(item, 0);
            l = PySequence_GetItem(item, 1);
            ok = a != NULL && l != NULL;
        }
        if (ok) {
            addr = PyLong_AsSsize_t(a);
            len = addr == -1 && PyErr_Occurred() ? -1 : PyLong_AsSsize_t(l);
            ok = !PyErr_Occurred();
        }
        Py_XDECREF(a);
        Py_XDECREF(l);
        Py_XDECREF(item);
        if (!ok) {
            PyErr_Clear();
            PyErr_Format(PyExc_TypeError, "%s: segment %zd is not an (address, length) pair of integers", fn, i);
            goto fail;
        }
        if (len < 0 || addr < 0) {
            PyErr_Format(PyExc_ValueError, "%s: segment %zd has a negative %s", fn, i, len < 0 ? "length" : "address");
            goto fail;
        }
        if (addr == 0 && dir == GATHER && len > 0) {
            PyErr_Format(PyExc_ValueError, "%s: segment %zd has address 0; every source must be real memory", fn, i);
            goto fail;
        }
        if ((size_t)addr > SIZE_MAX - (size_t)len || sum > SIZE_MAX - (size_t)len) {
            PyErr_Format(PyExc_OverflowError, "%s: segment %zd runs past the end of the address space", fn, i);
            goto fail;
        }
        segs[i].addr = (uint8_t *)(uintptr_t)addr;
        segs[i].len = (size_t)len;
        sum += (size_t)len;
    }
    *out = segs;
    *total = sum;
    return n;
fail:
    PyMem_Free(segs);
    return -1;
}

/* Hash a stream of 240 bytes or fewer with xxhash, copying it too: assembled on the stack first, so
 * the hash and the copy see the same bytes. */
static PyObject *short_copy_hash(uint8_t *contig, int contig_is_dst, const segment *segs, Py_ssize_t nsegs) {
    uint8_t buf[SHORT_MAX];
    size_t off = 0;
    for (Py_ssize_t i = 0; i < nsegs; i++) {
        if (segs[i].len == 0) continue;
        if (contig_is_dst) {
            memcpy(buf + off, segs[i].addr, segs[i].len);
            memcpy(contig + off, buf + off, segs[i].len);
        } else {
            memcpy(buf + off, contig + off, segs[i].len);
            if (segs[i].addr) memcpy(segs[i].addr, buf + off, segs[i].len);
        }
        off += segs[i].len;
    }
    PyObject *bytes = PyBytes_FromStringAndSize((const char *)buf, (Py_ssize_t)off);
    if (bytes == NULL) return NULL;
    PyObject *digest = PyObject_CallFunctionObjArgs(xxh3_short, bytes, NULL);
    Py_DECREF(bytes);
    return digest;
}

/* The one worker of every entry point: `contig` is the contiguous side (the destination of a gather,
 * the source of a scatter); segments are the other side. */
static PyObject *run(uint8_t *contig, direction dir, const segment *segs, Py_ssize_t nsegs, size_t total,
                     int nontemporal) {
    if (total <= SHORT_MAX) return short_copy_hash(contig, dir == GATHER, segs, nsegs);
    stream st;
    stream_init(&st, total, active_path->kernel, nontemporal);
    Py_BEGIN_ALLOW_THREADS
    size_t off = 0;
    for (Py_ssize_t i = 0; i < nsegs; i++) {
        if (dir == GATHER)
            stream_feed(&st, contig + off, segs[i].addr, segs[i].len);
        else
            stream_feed(&st, segs[i].addr, contig + off, segs[i].len);
        off += segs[i].len;
    }
    Py_END_ALLOW_THREADS
    return PyLong_FromUnsignedLongLong(stream_digest(&st));
}

#define NONTEMPORAL_DOC                                                                                      \
    "With nontemporal=True, whole aligned kilobytes of the destination are written around the CPU cache,\n"  \
    "which saves reading each line before overwriting it: for memory other processes read (the pool), or\n" \
    "copies too large to stay in cache anyway."

PyDoc_STRVAR(copy_hash_doc,
             "copy_hash(dst, src, *, nontemporal=False) -> int\n\n"
             "Copy buffer src into the writable buffer dst (of the same size) and return xxh3_64 of the bytes.\n"
             NONTEMPORAL_DOC);

static PyObject *copy_hash(PyObject *self, PyObject *args, PyObject *kwargs) {
    static char *keywords[] = {"dst", "src", "nontemporal", NULL};
    PyObject *dst_obj, *src_obj;
    int nontemporal = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OO|$p:copy_hash", keywords, &dst_obj, &src_obj, &nontemporal))
        return NULL;
    Py_buffer dst, src;
    if (get_buffer(dst_obj, &dst, 1, "copy_hash", "dst") < 0) return NULL;
    if (get_buffer(src_obj, &src, 0, "copy_hash", "src") < 0) {
        PyBuffer_Release(&dst);
        return NULL;
    }
    PyObject *out = NULL;
    if (dst.len != src.len) {
        PyErr_Format(PyExc_ValueError, "copy_hash: dst holds %zd bytes, src %zd; they must be the same size", dst.len,
                     src.len);
    } else {
        segment seg = {(uint8_t *)src.buf, (size_t)src.len};
        out = run(dst.buf, GATHER, &seg, 1, (size_t)src.len, nontemporal);
    }
    PyBuffer_Release(&src);
    PyBuffer_Release(&dst);
    return out;
}

PyDoc_STRVAR(hash_doc, "hash(buf) -> int\n\nxxh3_64 of the buffer's bytes (the hash alone, no copy).");

static PyObject *hash(PyObject *self, PyObject *arg) {
    Py_buffer buf;
    if (get_buffer(arg, &buf, 0, "hash", "buf") < 0) return NULL;
    segment seg = {NULL, (size_t)buf.len};
    PyObject *out = run(buf.buf, SCATTER, &seg, 1, (size_t)buf.len, 0);
    PyBuffer_Release(&buf);
    return out;
}

static PyObject *segments_entry(PyObject *args, PyObject *kwargs, direction dir, const char *fn) {
    static char *gather_keywords[] = {"dst", "segments", "nontemporal", NULL};
    static char *scatter_keywords[] = {"src", "segments", "nontemporal", NULL};
    PyObject *buf_obj, *seq;
    int nontemporal = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, dir == GATHER ? "OO|$p:gather_hash" : "OO|$p:scatter_hash",
                                     dir == GATHER ? gather_keywords : scatter_keywords, &buf_obj, &seq, &nontemporal))
        return NULL;
    Py_buffer buf;
    if (get_buffer(buf_obj, &buf, dir == GATHER, fn, dir == GATHER ? "dst" : "src") < 0) return NULL;
    segment *segs = NULL;
    size_t total = 0;
    PyObject *out = NULL;
    Py_ssize_t n = parse_segments(seq, dir, fn, &segs, &total);
    if (n >= 0) {
        if (total != (size_t)buf.len)
            PyErr_Format(PyExc_ValueError, "%s: segments hold %zu bytes, %s %zd; they must be equal", fn, total,
                         dir == GATHER ? "dst" : "src", buf.len);
        else
            out = run(buf.buf, dir, segs, n, total, nontemporal);
        PyMem_Free(segs);
    }
    PyBuffer_Release(&buf);
    return out;
}

PyDoc_STRVAR(gather_hash_doc,
             "gather_hash(dst, segments, *, nontemporal=False) -> int\n\n"
             "Copy the memory ranges `segments`, (address, length) pairs, back to back into the writable\n"
             "buffer dst, whose size must be their total, and return xxh3_64 of the bytes copied. The\n"
             "addresses must stay valid for the call (the caller holds what they point into).\n"
             NONTEMPORAL_DOC);

static PyObject *gather_hash(PyObject *self, PyObject *args, PyObject *kwargs) {
    return segments_entry(args, kwargs, GATHER, "gather_hash");
}

PyDoc_STRVAR(scatter_hash_doc,
             "scatter_hash(src, segments, *, nontemporal=False) -> int\n\n"
             "Copy buffer src, back to back, into the memory ranges `segments`, (address, length) pairs\n"
             "whose total is src's size, and return xxh3_64 of all of src. Address 0 hashes that range of\n"
             "src without copying it anywhere.\n"
             NONTEMPORAL_DOC);

static PyObject *scatter_hash(PyObject *self, PyObject *args, PyObject *kwargs) {
    return segments_entry(args, kwargs, SCATTER, "scatter_hash");
}

/* Many streams in one call, with the GIL released once for all of them: a thread that copies a step's
 * chunks must not queue for the GIL between chunks behind a busy engine thread (each wait can last a
 * switch interval, 5 ms by default). `items` is a sequence of (buffer, segments) pairs. */
static PyObject *many_entry(PyObject *args, PyObject *kwargs, direction dir, const char *fn) {
    static char *keywords[] = {"items", "nontemporal", NULL};
    PyObject *items;
    int nontemporal = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, dir == GATHER ? "O|$p:gather_hash_many" : "O|$p:scatter_hash_many",
                                     keywords, &items, &nontemporal))
        return NULL;
    Py_ssize_t n = PySequence_Size(items);
    if (n < 0) {
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError, "%s: items must be a sequence of (buffer, segments) pairs", fn);
        return NULL;
    }
    size_t count = n ? (size_t)n : 1;
    Py_buffer *bufs = PyMem_Calloc(count, sizeof(Py_buffer));
    segment **segs = PyMem_Calloc(count, sizeof(segment *));
    Py_ssize_t *nsegs = PyMem_Calloc(count, sizeof(Py_ssize_t));
    size_t *totals = PyMem_Calloc(count, sizeof(size_t));
    uint64_t *digests = PyMem_Calloc(count, sizeof(uint64_t));
    PyObject *out = NULL;
    Py_ssize_t ready = 0; /* items whose buffer is held */
    if (!bufs || !segs || !nsegs || !totals || !digests) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++, ready++) {
        PyObject *item = PySequence_GetItem(items, i);
        if (item == NULL || !PySequence_Check(item) || PySequence_Size(item) != 2) {
            Py_XDECREF(item);
            PyErr_Clear();
            PyErr_Format(PyExc_TypeError, "%s: item %zd is not a (buffer, segments) pair", fn, i);
            goto done;
        }
        PyObject *buf_obj = PySequence_GetItem(item, 0), *seq = PySequence_GetItem(item, 1);
        Py_DECREF(item);
        int ok = buf_obj != NULL && seq != NULL &&
                 get_buffer(buf_obj, &bufs[i], dir == GATHER, fn, dir == GATHER ? "dst" : "src") == 0;
        Py_XDECREF(buf_obj);
        if (!ok) {
            Py_XDECREF(seq);
            goto done;
        }
        nsegs[i] = parse_segments(seq, dir, fn, &segs[i], &totals[i]);
        Py_DECREF(seq);
        if (nsegs[i] < 0) {
            PyBuffer_Release(&bufs[i]);
            goto done;
        }
        if (totals[i] != (size_t)bufs[i].len) {
            PyErr_Format(PyExc_ValueError, "%s: item %zd: segments hold %zu bytes, %s %zd; they must be equal", fn, i,
                         totals[i], dir == GATHER ? "dst" : "src", bufs[i].len);
            PyMem_Free(segs[i]);
            segs[i] = NULL;
            PyBuffer_Release(&bufs[i]);
            goto done;
        }
    }
    out = PyList_New(n);
    if (out == NULL) goto done;
    /* Short streams go through xxhash (it needs the GIL); the rest in one stretch without it. */
    for (Py_ssize_t i = 0; i < n; i++) {
        if (totals[i] > SHORT_MAX) continue;
        PyObject *digest = short_copy_hash(bufs[i].buf, dir == GATHER, segs[i], nsegs[i]);
        if (digest == NULL) {
            Py_CLEAR(out);
            goto done;
        }
        PyList_SetItem(out, i, digest);
    }
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) {
        if (totals[i] <= SHORT_MAX) continue;
        stream st;
        stream_init(&st, totals[i], active_path->kernel, nontemporal);
        uint8_t *contig = bufs[i].buf;
        size_t off = 0;
        for (Py_ssize_t j = 0; j < nsegs[i]; j++) {
            if (dir == GATHER)
                stream_feed(&st, contig + off, segs[i][j].addr, segs[i][j].len);
            else
                stream_feed(&st, segs[i][j].addr, contig + off, segs[i][j].len);
            off += segs[i][j].len;
        }
        digests[i] = stream_digest(&st);
    }
    Py_END_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) {
        if (totals[i] <= SHORT_MAX) continue;
        PyObject *digest = PyLong_FromUnsignedLongLong(digests[i]);
        if (digest == NULL) {
            Py_CLEAR(out);
            goto done;
        }
        PyList_SetItem(out, i, digest);
    }
done:
    for (Py_ssize_t i = 0; i < ready; i++) {
        PyMem_Free(segs[i]);
        PyBuffer_Release(&bufs[i]);
    }
    PyMem_Free(bufs);
    PyMem_Free(segs);
    PyMem_Free(nsegs);
    PyMem_Free(totals);
    PyMem_Free(digests);
    return out;
}

PyDoc_STRVAR(gather_hash_many_doc,
             "gather_hash_many(items, *, nontemporal=False) -> list[int]\n\n"
             "gather_hash for each (dst, segments) pair of items, with the GIL released once for all.");

static PyObject *gather_hash_many(PyObject *self, PyObject *args, PyObject *kwargs) {
    return many_entry(args, kwargs, GATHER, "gather_hash_many");
}

PyDoc_STRVAR(scatter_hash_many_doc,
             "scatter_hash_many(items, *, nontemporal=False) -> list[int]\n\n"
             "scatter_hash for each (src, segments) pair of items, with the GIL released once for all.");

static PyObject *scatter_hash_many(PyObject *self, PyObject *args, PyObject *kwargs) {
    return many_entry(args, kwargs, SCATTER, "scatter_hash_many");
}

PyDoc_STRVAR(simd_doc, "simd() -> str\n\nThe code path in use: avx512, avx2, sse2, neon or scalar.");

static PyObject *simd(PyObject *self, PyObject *unused) { return PyUnicode_FromString(active_path->name); }

PyDoc_STRVAR(simd_paths_doc, "simd_paths() -> tuple[str, ...]\n\nThe code paths this CPU can run, best first.");

static PyObject *simd_paths(PyObject *self, PyObject *unused) {
    PyObject *out = PyList_New(0);
    if (out == NULL) return NULL;
    for (size_t i = 0; i < NPATHS; i++) {
        if (!path_supported(&PATHS[i])) continue;
        PyObject *name = PyUnicode_FromString(PATHS[i].name);
        if (name == NULL || PyList_Append(out, name) < 0) {
            Py_XDECREF(name);
            Py_DECREF(out);
            return NULL;
        }
        Py_DECREF(name);
    }
    PyObject *tuple = PyList_AsTuple(out);
    Py_DECREF(out);
    return tuple;
}

PyDoc_STRVAR(set_simd_doc,
             "set_simd(name) -> str\n\n"
             "Use code path `name` from now on (for tests and measurements); returns the previous one.");

static PyObject *set_simd(PyObject *self, PyObject *arg) {
    const char *name = PyUnicode_AsUTF8AndSize(arg, NULL);
    if (name == NULL) return NULL;
    for (size_t i = 0; i < NPATHS; i++) {
        if (strcmp(PATHS[i].name, name) != 0) continue;
        if (!path_supported(&PATHS[i])) {
            PyErr_Format(PyExc_ValueError, "set_simd: this CPU cannot run the %s path", name);
            return NULL;
        }
        const char *previous = active_path->name;
        active_path = &PATHS[i];
        return PyUnicode_FromString(previous);
    }
    PyErr_Format(PyExc_ValueError, "set_simd: unknown path %R", arg);
    return NULL;
}

static PyMethodDef methods[] = {
    {"copy_hash", (PyCFunction)(void (*)(void))copy_hash, METH_VARARGS | METH_KEYWORDS, copy_hash_doc},
    {"gather_hash", (PyCFunction)(void (*)(void))gather_hash, METH_VARARGS | METH_KEYWORDS, gather_hash_doc},
    {"scatter_hash", (PyCFunction)(void (*)(void))scatter_hash, METH_VARARGS | METH_KEYWORDS, scatter_hash_doc},
    {"gather_hash_many", (PyCFunction)(void (*)(void))gather_hash_many, METH_VARARGS | METH_KEYWORDS,
     gather_hash_many_doc},
    {"scatter_hash_many", (PyCFunction)(void (*)(void))scatter_hash_many, METH_VARARGS | METH_KEYWORDS,
     scatter_hash_many_doc},
    {"hash", hash, METH_O, hash_doc},
    {"simd", simd, METH_NOARGS, simd_doc},
    {"simd_paths", simd_paths, METH_NOARGS, simd_paths_doc},
    {"set_simd", set_simd, METH_O, set_simd_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    "maru_pool._copyhash",
    "Copy bytes and compute their XXH3-64 in one pass (see maru_pool.copyhash).",
    -1,
    methods,
    NULL,
    NULL,
    NULL,
    NULL,
};

PyMODINIT_FUNC PyInit__copyhash(void) {
    PyObject *xxhash = PyImport_ImportModule("xxhash");
    if (xxhash == NULL) return NULL;
    xxh3_short = PyObject_GetAttrString(xxhash, "xxh3_64_intdigest");
    Py_DECREF(xxhash);
    if (xxh3_short == NULL) return NULL;
    for (size_t i = 0; i < NPATHS; i++) {
        if (path_supported(&PATHS[i])) {
            active_path = &PATHS[i];
            break;
        }
    }
    return PyModule_Create(&module);
}
