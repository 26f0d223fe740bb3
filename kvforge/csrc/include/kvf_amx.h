/* AMX tile setup (Sapphire Rapids and later Xeons), shared by the bf16 linear and prefill kernels.
 *
 * Why: a process may use the tile registers only after Linux grants it the tile state
 * (arch_prctl ARCH_REQ_XCOMP_PERM, XTILEDATA); where it refuses, or the compiler does not target AMX,
 * callers run their vector tiles. `KVF_AMX_BUILT` says whether this build has AMX code at all; each
 * kernel may add its own conditions (AVX512-BF16, a -DKVF_NO_AMX opt-out).
 */
#ifndef KVF_AMX_H
#define KVF_AMX_H

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#define KVF_AMX_BUILT 1
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

/* The LDTILECFG operand: palette 1, per tile its rows and bytes per row. */
typedef struct {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed, aligned(64))) kvf_amx_config;

/* 1 once Linux has granted this process the tile state (asked once per process and unit). */
static inline int kvf_amx_permitted(void) {
    static int state = -1;
    if (state < 0) state = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
    return state;
}

/* Tiles 0-7 as 16 rows x 64 bytes (the full tile); callers narrow the tiles they use otherwise. */
static inline void kvf_amx_config_full(kvf_amx_config *cfg) {
    memset(cfg, 0, sizeof *cfg);
    cfg->palette_id = 1;
    for (int t = 0; t < 8; t++) cfg->rows[t] = 16, cfg->colsb[t] = 64;
}
#else
#define KVF_AMX_BUILT 0
#endif

#endif
