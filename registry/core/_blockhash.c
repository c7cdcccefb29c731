/* Megatron-Core's parent-chained block hashes at native speed (registry.core.hashing).
 *
 * Each complete block of int64 little-endian tokens is hashed as
 * sha256(parent_digest + block bytes); the digest chains into the next block and the
 * block's hash is its first 8 bytes read little-endian, mod 2^63-1, plus 1. The Python
 * module is the specification and the fallback; this file computes the same numbers:
 * tokens packed straight from a list or tuple of exact ints (no intermediate array),
 * one SHA-256 compression per 64 bytes without an object or a call per block, the
 * hashing done without the GIL on large prompts, the digests of blocks hashed before
 * after the same parent remembered (compared byte for byte); a prompt of token ids
 * read straight from a request's JSON body.
 *
 * SHA-256 runs on the CPU's SHA extensions (x86-64 SHA-NI, chosen at run time by
 * CPUID) and otherwise on a portable C implementation (FIPS 180-4), the same digests.
 * Written for this project; no code from elsewhere.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <pythread.h>
#include <stdint.h>
#include <string.h>

#if (defined(__x86_64__) || defined(_M_X64)) && (defined(__GNUC__) || defined(__clang__))
#define PCR_HAVE_SHANI 1
#include <cpuid.h>
#include <immintrin.h>
#else
#define PCR_HAVE_SHANI 0
#endif

#define DIGEST_BYTES 32
#define HASH_MODULUS 0x7fffffffffffffffULL /* 2^63 - 1, as MAX_HASH in registry.core.types */
#define NOGIL_BYTES 16384 /* hash without the GIL from this many token bytes on */

static const uint32_t K256[64] = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4,
    0xab1c5ed5, 0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe,
    0x9bdc06a7, 0xc19bf174, 0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f,
    0x4a7484aa, 0x5cb0a9dc, 0x76f988da, 0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7,
    0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967, 0x27b70a85, 0x2e1b2138, 0x4d2c6dfc,
    0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85, 0xa2bfe8a1, 0xa81a664b,
    0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070, 0x19a4c116,
    0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7,
    0xc67178f2};

static const uint32_t H256[8] = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
                                 0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};

/* One chain step: the digest of a padded message of `blocks` 64-byte blocks. */
typedef void (*digest_fn)(const uint8_t *message, size_t blocks, uint8_t digest[DIGEST_BYTES]);

/* ---- portable SHA-256 ------------------------------------------------------------ */

static inline uint32_t rotr32(uint32_t x, unsigned n) { return (x >> n) | (x << (32 - n)); }

static inline uint32_t load_be32(const uint8_t *p) {
    return ((uint32_t)p[0] << 24) | ((uint32_t)p[1] << 16) | ((uint32_t)p[2] << 8) | p[3];
}

static inline void store_be32(uint8_t *p, uint32_t v) {
    p[0] = (uint8_t)(v >> 24);
    p[1] = (uint8_t)(v >> 16);
    p[2] = (uint8_t)(v >> 8);
    p[3] = (uint8_t)v;
}

static void compress_portable(uint32_t state[8], const uint8_t *block) {
    uint32_t w[64];
    for (int i = 0; i < 16; i++) w[i] = load_be32(block + 4 * i);
    for (int i = 16; i < 64; i++) {
        uint32_t s0 = rotr32(w[i - 15], 7) ^ rotr32(w[i - 15], 18) ^ (w[i - 15] >> 3);
        uint32_t s1 = rotr32(w[i - 2], 17) ^ rotr32(w[i - 2], 19) ^ (w[i - 2] >> 10);
        w[i] = w[i - 16] + s0 + w[i - 7] + s1;
    }
    uint32_t a = state[0], b = state[1], c = state[2], d = state[3];
    uint32_t e = state[4], f = state[5], g = state[6], h = state[7];
    for (int i = 0; i < 64; i++) {
        uint32_t t1 = h + (rotr32(e, 6) ^ rotr32(e, 11) ^ rotr32(e, 25)) + ((e & f) ^ (~e & g)) +
                      K256[i] + w[i];
        uint32_t t2 = (rotr32(a, 2) ^ rotr32(a, 13) ^ rotr32(a, 22)) + ((a & b) ^ (a & c) ^ (b & c));
        h = g;
        g = f;
        f = e;
        e = d + t1;
        d = c;
        c = b;
        b = a;
        a = t1 + t2;
    }
    state[0] += a;
    state[1] += b;
    state[2] += c;
    state[3] += d;
    state[4] += e;
    state[5] += f;
    state[6] += g;
    state[7] += h;
}

static void digest_portable(const uint8_t *message, size_t blocks, uint8_t digest[DIGEST_BYTES]) {
    uint32_t state[8];
    memcpy(state, H256, sizeof state);
    for (size_t i = 0; i < blocks; i++) compress_portable(state, message + 64 * i);
    for (int i = 0; i < 8; i++) store_be32(digest + 4 * i, state[i]);
}

/* ---- SHA-256 on x86-64 SHA extensions ------------------------------------------- */
#if PCR_HAVE_SHANI

/* Two rounds, then the next two: the state travels as (A,B,E,F) and (C,D,G,H). */
#define SHANI_ROUNDS(abef, cdgh, wk)                        \
    do {                                                    \
        cdgh = _mm_sha256rnds2_epu32(cdgh, abef, wk);       \
        abef = _mm_sha256rnds2_epu32(abef, cdgh,            \
                                     _mm_shuffle_epi32(wk, 0x0E)); \
    } while (0)

/* The next four schedule words from the last sixteen (w0 the oldest four). */
#define SHANI_SCHEDULE(w0, w1, w2, w3)                                                   \
    (w0 = _mm_sha256msg2_epu32(                                                          \
         _mm_add_epi32(_mm_sha256msg1_epu32(w0, w1), _mm_alignr_epi8(w3, w2, 4)), w3))

__attribute__((target("sha,sse4.1,ssse3"))) static void
digest_shani(const uint8_t *message, size_t blocks, uint8_t digest[DIGEST_BYTES]) {
    const __m128i byteswap = _mm_set_epi64x(0x0c0d0e0f08090a0bULL, 0x0405060700010203ULL);
    /* H0..H7 as (A,B,E,F) and (C,D,G,H), lane 3 first. */
    __m128i abef = _mm_set_epi32((int)H256[0], (int)H256[1], (int)H256[4], (int)H256[5]);
    __m128i cdgh = _mm_set_epi32((int)H256[2], (int)H256[3], (int)H256[6], (int)H256[7]);
    for (size_t b = 0; b < blocks; b++) {
        const uint8_t *block = message + 64 * b;
        __m128i abef_in = abef, cdgh_in = cdgh;
        __m128i w[4];
        for (int i = 0; i < 4; i++)
            w[i] = _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)(block + 16 * i)), byteswap);
#pragma GCC unroll 16
        for (int g = 0; g < 16; g++) {
            if (g >= 4) SHANI_SCHEDULE(w[g & 3], w[(g + 1) & 3], w[(g + 2) & 3], w[(g + 3) & 3]);
            __m128i wk = _mm_add_epi32(w[g & 3], _mm_loadu_si128((const __m128i *)(K256 + 4 * g)));
            SHANI_ROUNDS(abef, cdgh, wk);
        }
        abef = _mm_add_epi32(abef, abef_in);
        cdgh = _mm_add_epi32(cdgh, cdgh_in);
    }
    /* Back to A..H in order: lanes (F,E,B,A) and (H,G,D,C) reordered, then big-endian. */
    __m128i feba = _mm_shuffle_epi32(abef, 0x1B);
    __m128i dchg = _mm_shuffle_epi32(cdgh, 0xB1);
    __m128i dcba = _mm_blend_epi16(feba, dchg, 0xF0);
    __m128i hgfe = _mm_alignr_epi8(dchg, feba, 8);
    _mm_storeu_si128((__m128i *)digest, _mm_shuffle_epi8(dcba, byteswap));
    _mm_storeu_si128((__m128i *)(digest + 16), _mm_shuffle_epi8(hgfe, byteswap));
}

static int cpu_has_shani(void) {
    unsigned a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d)) return 0;
    if (!(c & (1u << 9)) || !(c & (1u << 19))) return 0; /* SSSE3, SSE4.1 */
    if (__get_cpuid_max(0, NULL) < 7) return 0;
    __cpuid_count(7, 0, a, b, c, d);
    return (b >> 29) & 1; /* SHA */
}
#endif

static digest_fn native_digest = digest_portable;

/* ---- tokens -------------------------------------------------------------------- */

static inline void store_le64(uint8_t *p, uint64_t v) {
    for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> (8 * i));
}

static inline uint64_t load_le64(const uint8_t *p) {
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--) v = (v << 8) | p[i];
    return v;
}

/* Packs a list or tuple of exact ints as int64 little-endian into `out`. Returns 1 when
 * done, 0 (nothing raised) at the first item that is not an exact int (a bool, a
 * subclass, a numpy scalar: the Python path decides), -1 with ValueError for an int
 * outside int64. */
static int pack_exact_ints(PyObject *seq, Py_ssize_t n, uint8_t *out) {
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = items[i];
        if (!PyLong_CheckExact(item)) return 0;
        int overflow;
        long long v = PyLong_AsLongLongAndOverflow(item, &overflow);
        if (overflow) {
            PyErr_SetString(PyExc_ValueError, "a token id does not fit in int64");
            return -1;
        }
        store_le64(out + 8 * i, (uint64_t)v);
    }
    return 1;
}

/* ---- the chain ----------------------------------------------------------------- */

/* ---- digests remembered ---------------------------------------------------------
 *
 * Prompts share their first blocks (a system prompt, a conversation's earlier turns),
 * so a block is mostly hashed after the same parent again and again. The last digests
 * computed are remembered in a table of slots, each holding a parent digest, the block's
 * bytes and the digest of both: a block found there with the same parent and bytes
 * (compared in full, never by a hash of them) takes the digest remembered, the same
 * one SHA-256 gives. Two slots side by side are found by the parent's first 8 bytes (a
 * digest: random) and the block's first token; a block not there takes the one of the
 * two used least recently. The table is allocated at
 * the first chain (MEMO_BYTES at most, for one block size at a time: another size
 * starts it again) and guarded by a lock only ever tried: a thread that finds it held
 * (another hashing a long prompt without the GIL) hashes without it. */

#define MEMO_BYTES (4u << 20)
#define MEMO_MAX_STEP 512 /* block sizes up to 64 tokens */

static PyThread_type_lock memo_lock = NULL;
static int memo_on = 1;
static uint8_t *memo_table = NULL;
static size_t memo_step = 0, memo_slots = 0, memo_slot_bytes = 0;
static uint64_t memo_tick = 0; /* counts lookups: a slot's last use */

/* The table for blocks of `step` bytes (the memo lock held), NULL where it cannot be. */
static uint8_t *memo_for(size_t step) {
    if (!memo_on || step > MEMO_MAX_STEP) return NULL;
    if (memo_table != NULL && memo_step == step) return memo_table;
    PyMem_RawFree(memo_table);
    memo_table = NULL;
    size_t slot_bytes = 8 + 2 * DIGEST_BYTES + step, slots = 2;
    while (2 * slots * slot_bytes <= MEMO_BYTES) slots *= 2;
    memo_table = PyMem_RawCalloc(slots, slot_bytes);
    if (memo_table == NULL) return NULL;
    memo_step = step;
    memo_slots = slots;
    memo_slot_bytes = slot_bytes;
    return memo_table;
}

/* Hashes `nblocks` blocks of `step` bytes from `data`, chained from `parent`, writing
 * each block's 32-byte digest to `digests`. `message` holds one padded message.
 * `remember`: digests are looked up and kept in the memo table where its lock is free.
 * Takes no Python object and never the GIL: called with or without it. */
static void chain_blocks(digest_fn digest, const uint8_t *parent, const uint8_t *data,
                         size_t step, size_t nblocks, uint8_t *message, size_t message_blocks,
                         uint8_t *digests, int remember) {
    size_t length = DIGEST_BYTES + step;
    memset(message + length, 0, 64 * message_blocks - length);
    message[length] = 0x80;
    uint64_t bits = (uint64_t)length * 8;
    for (int i = 0; i < 8; i++) message[64 * message_blocks - 1 - i] = (uint8_t)(bits >> (8 * i));
    int locked = remember && memo_lock != NULL && PyThread_acquire_lock(memo_lock, NOWAIT_LOCK);
    uint8_t *table = locked ? memo_for(step) : NULL;
    for (size_t k = 0; k < nblocks; k++) {
        const uint8_t *prior = k ? digests + DIGEST_BYTES * (k - 1) : parent;
        const uint8_t *block = data + step * k;
        uint8_t *out = digests + DIGEST_BYTES * k, *slot = NULL;
        if (table != NULL) {
            /* two slots side by side, each with the tick of its last use (0: empty) */
            uint64_t a, b, used[2];
            memcpy(&a, prior, 8);
            memcpy(&b, block, 8);
            uint64_t at = a ^ (b * 0x9e3779b97f4a7c15ULL);
            uint8_t *pair = table + ((at ^ (at >> 29)) & (memo_slots - 2)) * memo_slot_bytes;
            for (int w = 0; w < 2; w++) {
                uint8_t *one = pair + w * memo_slot_bytes;
                memcpy(&used[w], one, 8);
                if (used[w] && memcmp(one + 8, prior, DIGEST_BYTES) == 0 &&
                    memcmp(one + 8 + 2 * DIGEST_BYTES, block, step) == 0) {
                    slot = one;
                    break;
                }
            }
            memo_tick++;
            if (slot != NULL) {
                memcpy(slot, &memo_tick, 8);
                memcpy(out, slot + 8 + DIGEST_BYTES, DIGEST_BYTES);
                continue;
            }
            slot = used[0] <= used[1] ? pair : pair + memo_slot_bytes; /* the older one */
        }
        memcpy(message, prior, DIGEST_BYTES);
        memcpy(message + DIGEST_BYTES, block, step);
        digest(message, message_blocks, out);
        if (slot != NULL) {
            memcpy(slot, &memo_tick, 8);
            memcpy(slot + 8, prior, DIGEST_BYTES);
            memcpy(slot + 8 + DIGEST_BYTES, out, DIGEST_BYTES);
            memcpy(slot + 8 + 2 * DIGEST_BYTES, block, step);
        }
    }
    if (locked) PyThread_release_lock(memo_lock);
}

/* memo(on) -> bool: digests remembered from now on (True: the table kept meanwhile,
 * it is used again) or not (False); None: the table dropped, whatever is remembered
 * forgotten. Answers whether they were remembered. For measuring the chain itself. */
static PyObject *memo(PyObject *module, PyObject *arg) {
    (void)module;
    int on = arg == Py_None ? -1 : PyObject_IsTrue(arg);
    if (on == -1 && arg != Py_None) return NULL;
    if (memo_lock == NULL) Py_RETURN_FALSE;
    Py_BEGIN_ALLOW_THREADS
    PyThread_acquire_lock(memo_lock, WAIT_LOCK);
    Py_END_ALLOW_THREADS
    int was = memo_on;
    if (on >= 0) {
        memo_on = on;
    } else {
        PyMem_RawFree(memo_table);
        memo_table = NULL;
        memo_step = memo_slots = memo_slot_bytes = 0;
    }
    PyThread_release_lock(memo_lock);
    return PyBool_FromLong(was);
}

/* after_fork(): in a child process just forked, a new memo lock and nothing
 * remembered: a thread of the parent that held the lock (hashing a long prompt without
 * the GIL) does not exist in the child and would never release it. */
static PyObject *after_fork(PyObject *module, PyObject *unused) {
    (void)module;
    (void)unused;
    memo_lock = PyThread_allocate_lock(); /* the parent's is left: it may be held */
    memo_table = NULL;                    /* the parent's memory, left to the child as is */
    memo_step = memo_slots = memo_slot_bytes = 0;
    Py_RETURN_NONE;
}

/* chain(parent, tokens, block_size, digests, portable) -> list | None
 *
 * parent: 32 bytes. tokens: a list or tuple (None back at an item that is not an
 * exact int, so the caller packs it) or bytes already packed as int64 little-endian.
 * digests: True for each block's 32-byte digest, False for its hash (an int).
 * portable: True to use the portable SHA-256 even where the CPU has SHA extensions. */
static PyObject *chain(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "chain() takes exactly 5 arguments");
        return NULL;
    }
    PyObject *parent = args[0], *tokens = args[1];
    if (!PyBytes_Check(parent) || PyBytes_GET_SIZE(parent) != DIGEST_BYTES) {
        PyErr_SetString(PyExc_ValueError, "parent must be a 32-byte digest");
        return NULL;
    }
    Py_ssize_t block_size = PyLong_AsSsize_t(args[2]);
    if (block_size == -1 && PyErr_Occurred()) return NULL;
    if (block_size < 1) {
        PyErr_SetString(PyExc_ValueError, "block_size must be at least 1");
        return NULL;
    }
    int want_digests = PyObject_IsTrue(args[3]);
    int portable = PyObject_IsTrue(args[4]);
    if (want_digests < 0 || portable < 0) return NULL;
    digest_fn digest = portable ? digest_portable : native_digest;

    Py_ssize_t ntokens;
    uint8_t *packed = NULL;
    const uint8_t *data;
    if (PyList_CheckExact(tokens) || PyTuple_CheckExact(tokens)) {
        ntokens = PySequence_Fast_GET_SIZE(tokens);
        if (ntokens > PY_SSIZE_T_MAX / 8) return PyErr_NoMemory();
        packed = PyMem_Malloc(ntokens ? (size_t)ntokens * 8 : 1);
        if (packed == NULL) return PyErr_NoMemory();
        int done = pack_exact_ints(tokens, ntokens, packed);
        if (done <= 0) {
            PyMem_Free(packed);
            if (done < 0) return NULL;
            Py_RETURN_NONE;
        }
        data = packed;
    } else if (PyBytes_CheckExact(tokens)) {
        if (PyBytes_GET_SIZE(tokens) % 8) {
            PyErr_SetString(PyExc_ValueError, "packed tokens must be whole int64s");
            return NULL;
        }
        ntokens = PyBytes_GET_SIZE(tokens) / 8;
        data = (const uint8_t *)PyBytes_AS_STRING(tokens);
    } else {
        PyErr_SetString(PyExc_TypeError, "tokens must be a list, a tuple or packed bytes");
        return NULL;
    }

    size_t nblocks = (size_t)(ntokens / block_size);
    PyObject *result = PyList_New((Py_ssize_t)nblocks);
    if (result == NULL || nblocks == 0) {
        PyMem_Free(packed);
        return result;
    }
    size_t step = (size_t)block_size * 8;
    size_t message_blocks = (DIGEST_BYTES + step + 9 + 63) / 64;
    uint8_t *message = PyMem_Malloc(64 * message_blocks);
    uint8_t *digests = PyMem_Malloc(DIGEST_BYTES * nblocks);
    if (message == NULL || digests == NULL) {
        PyMem_Free(message);
        PyMem_Free(digests);
        PyMem_Free(packed);
        Py_DECREF(result);
        return PyErr_NoMemory();
    }
    const uint8_t *start = (const uint8_t *)PyBytes_AS_STRING(parent);
    if (step * nblocks >= NOGIL_BYTES) {
        /* Only memory this call owns, and immutable bytes it holds references to. */
        Py_BEGIN_ALLOW_THREADS
        chain_blocks(digest, start, data, step, nblocks, message, message_blocks, digests,
                     !portable);
        Py_END_ALLOW_THREADS
    } else {
        chain_blocks(digest, start, data, step, nblocks, message, message_blocks, digests,
                     !portable);
    }
    PyMem_Free(message);
    PyMem_Free(packed);
    for (size_t k = 0; k < nblocks; k++) {
        const uint8_t *d = digests + DIGEST_BYTES * k;
        PyObject *item = want_digests
                             ? PyBytes_FromStringAndSize((const char *)d, DIGEST_BYTES)
                             : PyLong_FromUnsignedLongLong(load_le64(d) % HASH_MODULUS + 1);
        if (item == NULL) {
            PyMem_Free(digests);
            Py_DECREF(result);
            return NULL;
        }
        PyList_SET_ITEM(result, (Py_ssize_t)k, item);
    }
    PyMem_Free(digests);
    return result;
}

/* token_ids(values, limit): whether ``values`` is a non-empty list of exact ints (never
   a bool or a float), each 0 <= v < limit (limit at most 2**62). What the gateway asks
   of a prompt of token ids before hashing it: one pass in C, no objects made. */
static PyObject *token_ids(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 2 || !PyList_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "token_ids(values: list, limit: int)");
        return NULL;
    }
    long long limit = PyLong_AsLongLong(args[1]);
    if (limit == -1 && PyErr_Occurred()) return NULL;
    PyObject *values = args[0];
    Py_ssize_t n = PyList_GET_SIZE(values);
    if (n == 0) Py_RETURN_FALSE;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *v = PyList_GET_ITEM(values, i);
        if (!PyLong_CheckExact(v)) Py_RETURN_FALSE;
        int overflow = 0;
        long long x = PyLong_AsLongLongAndOverflow(v, &overflow);
        if (overflow != 0 || x < 0 || x >= limit) Py_RETURN_FALSE;
    }
    Py_RETURN_TRUE;
}

/* ---- a prompt of token ids read straight from a request's body ---------------- */

#define SCAN_MAX_DEPTH 512 /* deeper nesting in another member: the caller parses it all */

static inline const uint8_t *skip_ws(const uint8_t *p, const uint8_t *end) {
    while (p < end && (*p == ' ' || *p == '\t' || *p == '\n' || *p == '\r')) p++;
    return p;
}

/* `p` at a string's opening quote: the byte after its closing quote (NULL: unended);
 * `*escaped` set where the string holds a backslash. */
static const uint8_t *skip_string(const uint8_t *p, const uint8_t *end, int *escaped) {
    for (p++; p < end; p++) {
        if (*p == '"') return p + 1;
        if (*p == '\\') {
            *escaped = 1;
            p++;
        }
    }
    return NULL;
}

/* `p` at a value: the byte after it (a scalar ends at white space, ',', '}' or ']'),
 * NULL where it does not end. Only strings and nesting are followed: the rest of the
 * JSON grammar is checked by the parser the caller hands the body to. */
static const uint8_t *skip_value(const uint8_t *p, const uint8_t *end) {
    int depth = 0, escaped = 0;
    while (p < end) {
        uint8_t c = *p;
        if (c == '"') {
            p = skip_string(p, end, &escaped);
            if (p == NULL || depth == 0) return p;
        } else if (c == '{' || c == '[') {
            if (++depth > SCAN_MAX_DEPTH) return NULL;
            p++;
        } else if (c == '}' || c == ']') {
            if (depth == 0) return p;
            p++;
            if (--depth == 0) return p;
        } else if (depth == 0 && (c == ',' || c == ' ' || c == '\t' || c == '\n' || c == '\r')) {
            return p;
        } else {
            p++;
        }
    }
    return depth == 0 ? p : NULL;
}

/* `p` just past '[': the ids up to the matching ']' packed as int64 little-endian into
 * `*out` (grown as needed), their count in `*count`; the byte after ']', or NULL where
 * an item is not a plain JSON integer in [0, limit) (a sign, a fraction, an exponent,
 * a leading zero, a nested list, a string) or the list is empty. */
static const uint8_t *scan_ids(const uint8_t *p, const uint8_t *end, uint64_t limit,
                               uint8_t **out, size_t *capacity, size_t *count) {
    p = skip_ws(p, end);
    if (p < end && *p == ']') return NULL;
    for (;;) {
        if (p >= end || *p < '0' || *p > '9') return NULL;
        uint64_t v = (uint64_t)(*p++ - '0');
        if (v == 0) {
            if (p < end && *p >= '0' && *p <= '9') return NULL;
        } else {
            while (p < end && *p >= '0' && *p <= '9') {
                v = v * 10 + (uint64_t)(*p++ - '0'); /* v < limit <= 2^62 before: no wrap */
                if (v >= limit) return NULL;
            }
        }
        if (v >= limit) return NULL;
        if (*count == *capacity) {
            size_t more = *capacity ? 2 * *capacity : 512;
            uint8_t *grown = PyMem_Realloc(*out, 8 * more);
            if (grown == NULL) {
                PyErr_NoMemory();
                return NULL;
            }
            *out = grown;
            *capacity = more;
        }
        store_le64(*out + 8 * (*count)++, v);
        p = skip_ws(p, end);
        if (p >= end) return NULL;
        if (*p == ']') return p + 1;
        if (*p != ',') return NULL;
        p = skip_ws(p + 1, end);
    }
}

/* prompt_ids(raw, limit) -> (start, end, packed) | None
 *
 * Where `raw` is a JSON object whose one member named "prompt" (no other member's name
 * escaped: an escape could spell it) holds a non-empty list of plain integers, each in
 * [0, limit): the list's span raw[start:end] and its ids packed as int64 little-endian
 * (what chain() takes), no Python object made per id. None for anything else, and
 * where the body is not JSON: the caller then parses the whole body. The span sits
 * between ':' and ',' or '}', so raw with it replaced by another value is JSON exactly
 * when raw is, with the same members (the caller parses that, and finds out). */
static PyObject *prompt_ids(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 2 || !PyBytes_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "prompt_ids(raw: bytes, limit: int)");
        return NULL;
    }
    long long limit = PyLong_AsLongLong(args[1]);
    if (limit == -1 && PyErr_Occurred()) return NULL;
    if (limit < 1 || limit > (1LL << 59)) {
        PyErr_SetString(PyExc_ValueError, "limit must be in [1, 2**59]");
        return NULL;
    }
    const uint8_t *base = (const uint8_t *)PyBytes_AS_STRING(args[0]);
    const uint8_t *end = base + PyBytes_GET_SIZE(args[0]);
    const uint8_t *p = skip_ws(base, end), *span = NULL, *span_end = NULL;
    uint8_t *packed = NULL;
    size_t capacity = 0, count = 0;
    if (p >= end || *p != '{') goto none;
    p = skip_ws(p + 1, end);
    for (;;) {
        if (p >= end || *p != '"') goto none;
        int escaped = 0;
        const uint8_t *name = p + 1;
        p = skip_string(p, end, &escaped);
        if (p == NULL || escaped) goto none;
        int is_prompt = (p - 1 - name == 6 && memcmp(name, "prompt", 6) == 0);
        p = skip_ws(p, end);
        if (p >= end || *p != ':') goto none;
        p = skip_ws(p + 1, end);
        if (is_prompt) {
            if (span != NULL || p >= end || *p != '[') goto none;
            span = p;
            p = scan_ids(p + 1, end, (uint64_t)limit, &packed, &capacity, &count);
            span_end = p;
        } else {
            p = skip_value(p, end);
        }
        if (p == NULL) goto none;
        p = skip_ws(p, end);
        if (p >= end) goto none;
        if (*p == '}') break;
        if (*p != ',') goto none;
        p = skip_ws(p + 1, end);
    }
    if (span == NULL || skip_ws(p + 1, end) != end) goto none;
    PyObject *ids = PyBytes_FromStringAndSize((const char *)packed, (Py_ssize_t)(8 * count));
    PyMem_Free(packed);
    if (ids == NULL) return NULL;
    return Py_BuildValue("(nnN)", (Py_ssize_t)(span - base), (Py_ssize_t)(span_end - base), ids);
none:
    PyMem_Free(packed);
    if (PyErr_Occurred()) return NULL;
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"chain", (PyCFunction)(void (*)(void))chain, METH_FASTCALL,
     "chain(parent, tokens, block_size, digests, portable): block hashes or digests."},
    {"token_ids", (PyCFunction)(void (*)(void))token_ids, METH_FASTCALL,
     "token_ids(values, limit): a non-empty list of ints (not bools), each in [0, limit)."},
    {"after_fork", (PyCFunction)after_fork, METH_NOARGS,
     "after_fork(): a forked child's own memo lock and table (os.register_at_fork)."},
    {"memo", (PyCFunction)memo, METH_O,
     "memo(on): digests of blocks remembered (True) or not; None forgets them."},
    {"prompt_ids", (PyCFunction)(void (*)(void))prompt_ids, METH_FASTCALL,
     "prompt_ids(raw, limit): the span and packed ids of a JSON body's prompt of token ids."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "registry.core._blockhash",
    "Megatron-Core's block-hash chain at native speed (see registry.core.hashing).", -1,
    methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__blockhash(void) {
    PyObject *module = PyModule_Create(&module_def);
    if (module == NULL) return NULL;
    if (memo_lock == NULL) memo_lock = PyThread_allocate_lock(); /* none: never remembered */
    const char *sha = "portable";
#if PCR_HAVE_SHANI
    if (cpu_has_shani()) {
        native_digest = digest_shani;
        sha = "sha-ni";
    }
#endif
    if (PyModule_AddStringConstant(module, "SHA256", sha) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
