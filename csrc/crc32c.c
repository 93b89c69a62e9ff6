/* CRC-32C with a hardware path (SSE4.2 crc32 on x86-64, three interleaved
 * streams for long inputs; the CRC extension on AArch64) chosen once, when
 * the module is loaded, and a slicing-by-8 software path
 * for every other CPU. Both paths produce identical results; the tests
 * check the RFC 3720 vectors on whichever path the machine takes and on
 * the software path explicitly. */
#include "crc32c.h"

#include <string.h>

#define POLY 0x82F63B78u

static uint32_t table[8][256];
static int table_ready = 0;

static void build_table(void) {
    for (uint32_t n = 0; n < 256; n++) {
        uint32_t c = n;
        for (int k = 0; k < 8; k++)
            c = (c & 1) ? (c >> 1) ^ POLY : c >> 1;
        table[0][n] = c;
    }
    for (uint32_t n = 0; n < 256; n++) {
        uint32_t c = table[0][n];
        for (int k = 1; k < 8; k++) {
            c = table[0][c & 0xff] ^ (c >> 8);
            table[k][n] = c;
        }
    }
    table_ready = 1;
}

uint32_t txmq_crc32c_software(uint32_t crc, const void *data, size_t len) {
    const unsigned char *p = (const unsigned char *)data;
    if (!table_ready)
        build_table();
    crc = ~crc;
    while (len && ((uintptr_t)p & 7)) {
        crc = table[0][(crc ^ *p++) & 0xff] ^ (crc >> 8);
        len--;
    }
    while (len >= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        w ^= crc;
        crc = table[7][w & 0xff] ^ table[6][(w >> 8) & 0xff] ^
              table[5][(w >> 16) & 0xff] ^ table[4][(w >> 24) & 0xff] ^
              table[3][(w >> 32) & 0xff] ^ table[2][(w >> 40) & 0xff] ^
              table[1][(w >> 48) & 0xff] ^ table[0][(w >> 56) & 0xff];
        p += 8;
        len -= 8;
    }
    while (len--)
        crc = table[0][(crc ^ *p++) & 0xff] ^ (crc >> 8);
    return ~crc;
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <nmmintrin.h>
#define TXMQ_HAVE_HW 1

/* The crc32 instruction has a latency of 3 cycles and a throughput of 1
 * per cycle, so one dependent stream of them runs at a third of what the
 * CPU can do. Long inputs are cut into three blocks, each one's CRC taken
 * in its own stream, interleaved, and the three joined: the CRC register
 * is linear in GF(2), so the CRC of A||B from register r is
 * Z_|B|(crc(r, A)) ^ crc(0, B), where Z_n is the effect of n zero bytes
 * on the register. Z_n for the two block sizes used is a table of four
 * byte lookups, built once from the 32 images of the register's bits. */
#define TXMQ_CRC_LONG 8192
#define TXMQ_CRC_SHORT 256

static uint32_t zeros_long[4][256], zeros_short[4][256];

__attribute__((target("sse4.2")))
static uint32_t crc32c_zeros(uint32_t reg, size_t n) {
    uint64_t c = reg;
    for (size_t i = 0; i < n; i += 8)
        c = _mm_crc32_u64(c, 0);
    return (uint32_t)c;
}

static void build_zeros(uint32_t t[4][256], size_t n) {
    uint32_t bit[32];
    for (int i = 0; i < 32; i++)
        bit[i] = crc32c_zeros(1u << i, n);
    for (int k = 0; k < 4; k++)
        for (int b = 0; b < 256; b++) {
            uint32_t v = 0;
            for (int j = 0; j < 8; j++)
                if (b & (1 << j))
                    v ^= bit[8 * k + j];
            t[k][b] = v;
        }
}

static inline uint32_t apply_zeros(uint32_t t[4][256], uint32_t c) {
    return t[0][c & 0xff] ^ t[1][(c >> 8) & 0xff] ^ t[2][(c >> 16) & 0xff] ^ t[3][c >> 24];
}

/* The CRCs of three consecutive blocks of n bytes (n a multiple of 8) from
 * register c, joined with the table of n zero bytes. */
__attribute__((target("sse4.2")))
static uint64_t crc32c_3way(uint64_t c, const unsigned char *p, size_t n, uint32_t zeros[4][256]) {
    uint64_t c1 = 0, c2 = 0;
    for (size_t i = 0; i < n; i += 8) {
        uint64_t a, b, d;
        memcpy(&a, p + i, 8);
        memcpy(&b, p + n + i, 8);
        memcpy(&d, p + 2 * n + i, 8);
        c = _mm_crc32_u64(c, a);
        c1 = _mm_crc32_u64(c1, b);
        c2 = _mm_crc32_u64(c2, d);
    }
    c = apply_zeros(zeros, (uint32_t)c) ^ (uint32_t)c1;
    return apply_zeros(zeros, (uint32_t)c) ^ (uint32_t)c2;
}

__attribute__((target("sse4.2")))
static uint32_t crc32c_hw(uint32_t crc, const void *data, size_t len) {
    const unsigned char *p = (const unsigned char *)data;
    uint64_t c = ~crc;
    while (len && ((uintptr_t)p & 7)) {
        c = _mm_crc32_u8((uint32_t)c, *p++);
        len--;
    }
    while (len >= 3 * TXMQ_CRC_LONG) {
        c = crc32c_3way(c, p, TXMQ_CRC_LONG, zeros_long);
        p += 3 * TXMQ_CRC_LONG;
        len -= 3 * TXMQ_CRC_LONG;
    }
    while (len >= 3 * TXMQ_CRC_SHORT) {
        c = crc32c_3way(c, p, TXMQ_CRC_SHORT, zeros_short);
        p += 3 * TXMQ_CRC_SHORT;
        len -= 3 * TXMQ_CRC_SHORT;
    }
    while (len >= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        c = _mm_crc32_u64(c, w);
        p += 8;
        len -= 8;
    }
    while (len--)
        c = _mm_crc32_u8((uint32_t)c, *p++);
    return ~(uint32_t)c;
}

static int detect_hw(void) {
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("sse4.2"))
        return 0;
    build_zeros(zeros_long, TXMQ_CRC_LONG);
    build_zeros(zeros_short, TXMQ_CRC_SHORT);
    return 1;
}
#elif defined(__aarch64__) && defined(__GNUC__) && defined(__linux__)
#include <sys/auxv.h>
#include <arm_acle.h>
#define TXMQ_HAVE_HW 1
#ifndef HWCAP_CRC32
#define HWCAP_CRC32 (1 << 7)
#endif

__attribute__((target("+crc")))
static uint32_t crc32c_hw(uint32_t crc, const void *data, size_t len) {
    const unsigned char *p = (const unsigned char *)data;
    uint32_t c = ~crc;
    while (len >= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        c = __crc32cd(c, w);
        p += 8;
        len -= 8;
    }
    while (len--)
        c = __crc32cb(c, *p++);
    return ~c;
}

static int detect_hw(void) { return (getauxval(AT_HWCAP) & HWCAP_CRC32) != 0; }
#endif

static int hw_state = -1; /* -1 unknown, 0 software, 1 hardware */

#if defined(__GNUC__) || defined(__clang__)
/* Detected, and every table built, when the extension module is loaded,
 * so no two threads ever race to do it. */
__attribute__((constructor)) static void detect_at_load(void) {
    build_table();
    (void)txmq_crc32c_hardware();
}
#endif

int txmq_crc32c_hardware(void) {
#ifdef TXMQ_HAVE_HW
    if (hw_state < 0)
        hw_state = detect_hw() ? 1 : 0;
    return hw_state;
#else
    return 0;
#endif
}

uint32_t txmq_crc32c_update(uint32_t crc, const void *data, size_t len) {
#ifdef TXMQ_HAVE_HW
    if (txmq_crc32c_hardware())
        return crc32c_hw(crc, data, len);
#endif
    return txmq_crc32c_software(crc, data, len);
}
