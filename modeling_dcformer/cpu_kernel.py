"""The "kernel" DCMHA implementation for CPU inference: Compose, mask, softmax and Compose again in one C function
that works in place on a chunk's raw q.k scores, a few query rows at a time, so that each row's scores stay in the
core's cache between the steps and no [heads, chunk, keys] tensor is allocated between the two matrix products.

The C source below is built on first use with the system's C compiler (`$CC`, else cc, gcc or clang) into a library
cached under `$DCFORMER_CACHE` (default `~/.cache/dcformer`), keyed by the source, the flags and the CPU, and
called through ctypes. No torch headers are needed, so a build takes about a second. Forward only (no autograd):
the model uses it where nothing needs gradients (`torch.is_grad_enabled()` false or no input requiring grad).
"""

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch
from transformers.utils import logging

logger = logging.get_logger(__name__)

MAX_RANK = 8  # dynamic_rank supported by the kernel (its per-block buffers are sized by it)

SOURCE = r"""
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define BLOCK 128      /* keys per block: the rows of a tile share the block's key factors, copied to L1 */
#define MAX_RANK 8

/* exp(x) for x <= 0 (Cephes' expf polynomial, within 2 ulp), 0 below -87.3; written so that loops vectorise */
static inline float exp_nonpos(float x) {
    float xc = x < -87.3f ? -87.3f : x;
    float fx = floorf(xc * 1.44269504088896341f + 0.5f);
    float r = xc - fx * 0.693359375f + fx * 2.12194440e-4f;
    float y = 1.9875691500e-4f;
    y = y * r + 1.3981999507e-3f;
    y = y * r + 8.3334519073e-3f;
    y = y * r + 4.1665795894e-2f;
    y = y * r + 1.6666665459e-1f;
    y = y * r + 5.0000001201e-1f;
    y = y * r * r + r + 1.0f;
    union { int32_t i; float f; } u;
    u.i = ((int32_t)fx + 127) << 23;
    return x < -87.3f ? 0.0f : y * u.f;
}

typedef float vf __attribute__((vector_size(64)));   /* 16 floats: AVX-512, or split in two AVX registers */
typedef int32_t vi __attribute__((vector_size(64)));
#define VW 16

static inline vf load(const float *p) { vf v; __builtin_memcpy(&v, p, sizeof v); return v; }
static inline void store(float *p, vf v) { __builtin_memcpy(p, &v, sizeof v); }

/* One Compose (spec, step 6) of 16 keys j..j+15 of one query row, in place: the M heads' values a[n][j]
   (a: [M][BLOCK]) become, with A[n] = a[n][j] * sc[n] (the scale, or the softmax's 1 / sum of head n),
       out[m] = A[m] (1 + qdd[m]) + sum_i hq_i qw2[i][m] + A[m] kdd[m][j] + sum_i hk_i[j] kw2[i][m][j]
   where hq_i = sum_n A[n] qw1[i][n] and hk_i[j] = sum_n A[n] kw1[i][n][j]. q: the row's query factors
   [2I+1][M]; k: the block's key factors [2I+1][M][BLOCK], or NULL (query-wise).
   Keys outside [lo, hi) or padding (pad[j] == 0, where pad) are set to `fill`. The hidden values stay in
   registers: each score is read twice and written once. Inlined with I constant (the loops over i unroll). */
static inline __attribute__((always_inline)) void compose16(
        float *a, int j, int M, const int I, const float *q, const float *k, const float *sc, const int masked,
        int lo, int hi, const uint8_t *pad, float fill, float *mx) {
    vf hq[MAX_RANK], hk[MAX_RANK];
    for (int i = 0; i < I; i++) hq[i] = hk[i] = (vf){0};
    for (int n = 0; n < M; n++) {
        const vf x = load(a + n * BLOCK + j) * sc[n];
        for (int i = 0; i < I; i++) {
            hq[i] += x * q[i * M + n];
            if (k) hk[i] += x * load(k + (i * M + n) * BLOCK + j);
        }
    }
    vi keep = {0};
    if (masked) {
        const vi idx = (vi){0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15} + j;
        keep = (idx >= lo) & (idx < hi);
        if (pad) {
            vi p;
            for (int l = 0; l < VW; l++) p[l] = pad[j + l];
            keep &= p != 0;
        }
    }
    const vi fillv = (vi)((vf){0} + fill);
    for (int m = 0; m < M; m++) {
        const vf x = load(a + m * BLOCK + j) * sc[m];
        vf out = x * (1.0f + q[2 * I * M + m]);
        for (int i = 0; i < I; i++) out += hq[i] * q[(I + i) * M + m];
        if (k) {
            out += x * load(k + (2 * I * M + m) * BLOCK + j);
            for (int i = 0; i < I; i++) out += hk[i] * load(k + ((I + i) * M + m) * BLOCK + j);
        }
        if (masked) out = (vf)(((vi)out & keep) | (fillv & ~keep));
        if (mx) {
            const vf top = load(mx + m * VW);
            const vi up = out > top;
            store(mx + m * VW, (vf)(((vi)out & up) | ((vi)top & ~up)));
        }
        store(a + m * BLOCK + j, out);
    }
}

/* compose16 over the keys [0, L) of a block (L a multiple of 16); the loop is compiled apart for each rank up to
   4, with and without key-wise factors, with and without masked keys. mx: each head's running maximum (16 lanes)
   or NULL: [M][16]. */
static void compose_block(float *a, int L, int M, int I, const float *q, const float *k, const float *sc, int lo,
                          int hi, const uint8_t *pad, float fill, float *mx) {
    const int masked = lo > 0 || hi < L || pad;
#define COMPOSE_LOOP(RANK, K, MASKED) \
    for (int j = 0; j < L; j += VW) compose16(a, j, M, RANK, q, K, sc, MASKED, lo, hi, pad, fill, mx)
#define COMPOSE_KM(RANK)                                       \
    if (k && masked) COMPOSE_LOOP(RANK, k, 1);                  \
    else if (k) COMPOSE_LOOP(RANK, k, 0);                       \
    else if (masked) COMPOSE_LOOP(RANK, (const float *)0, 1);   \
    else COMPOSE_LOOP(RANK, (const float *)0, 0);
    switch (I) {
        case 1: COMPOSE_KM(1); break;
        case 2: COMPOSE_KM(2); break;
        case 3: COMPOSE_KM(3); break;
        case 4: COMPOSE_KM(4); break;
        default: COMPOSE_KM(I);
    }
#undef COMPOSE_KM
#undef COMPOSE_LOOP
}

/* The exponentials of the softmax of one row of n values, in place, given the row's maximum (16 lanes); returns
   1 / (sum of exp(x - max)): the caller multiplies by it (in the Compose that follows). Partial sums in 16 lanes,
   so that the loop vectorises. */
static float softmax_row(float *restrict x, int n, const float *mx) {
    float lane[16], top = -FLT_MAX;
    for (int l = 0; l < VW; l++) top = mx[l] > top ? mx[l] : top;
    for (int l = 0; l < 16; l++) lane[l] = 0.0f;
    int j = 0;
    for (; j + 16 <= n; j += 16)
        for (int l = 0; l < 16; l++) {
            const float e = exp_nonpos(x[j + l] - top);
            x[j + l] = e;
            lane[l] += e;
        }
    float sum = 0.0f;
    for (; j < n; j++) {
        x[j] = exp_nonpos(x[j] - top);
        sum += x[j];
    }
    for (int l = 0; l < 16; l++) sum += lane[l];
    return 1.0f / sum;
}

/* DCMHA between the two matrix products, for one chunk, in place.
   scores: [B, G*M, c, s] contiguous, the raw q.k products; on return the composed probabilities.
   qt: [B, G, 2, 2I+1, M, T] (slots pre, post; time last), the chunk's first query at time index t0.
   kt: [B, G, 2, 2I+1, M, S] (time last), the chunk's first key at index s0; NULL for query-wise composition.
   pad: [B, pad_stride] bytes, 1 for a real key, the chunk's first key at index s0; or NULL. Query r of the chunk
   sits at absolute position qpos0 + r, key j at kpos0 + j; the query sees the key when kpos <= qpos,
   kpos > qpos - window (window > 0) and the key is real.
   Rows are taken `rows` at a time (a tile that fits one core's cache), each tile in three steps: Compose before
   the softmax (masked keys -FLT_MAX), the softmax of each head's row, Compose after it (masked keys 0; the
   softmax's division folded into it). Compose works on blocks of BLOCK keys copied to contiguous buffers (the
   heads' rows, the block's key factors, the row's query factors): in place, the rows of the M heads and of the
   factors lie a multiple of 4 KiB apart and would compete for the same few L1 cache sets.
   Returns 0, or 1 for arguments out of range, 2 out of memory. */
int dcmha_chunk(float *scores, int B, int G, int M, int c, int s, int I,
                const float *qt, int64_t T, int64_t t0, const float *kt, int64_t S, int64_t s0,
                const uint8_t *pad, int64_t pad_stride, int64_t qpos0, int64_t kpos0, int64_t window,
                float scale, int rows, int nthreads) {
    if (I > MAX_RANK || I < 1 || M < 1 || rows < 1) return 1;
    const int W = 2 * I + 1;
    const int ntiles = (c + rows - 1) / rows;
    int failed = 0;
#pragma omp parallel for collapse(2) schedule(dynamic) num_threads(nthreads)
    for (int bg = 0; bg < B * G; bg++) {
        for (int tile = 0; tile < ntiles; tile++) {
            const int b = bg / G;
            const int r0 = tile * rows, r1 = r0 + rows < c ? r0 + rows : c, R = r1 - r0;
            /* per row and head: 1 / sum of the softmax; the scale; a block of scores, of key factors; the
               query factors of each row */
            float *sc = malloc(sizeof(float) * ((size_t)(R + 1) * M + (size_t)(1 + W) * M * BLOCK + (size_t)R * W * M));
            float *mx = malloc(sizeof(float) * VW * (size_t)R * M);  /* per row and head: max of the composed scores */
            if (!sc || !mx) {
                free(mx);
#pragma omp atomic write
                failed = 1;
                continue;
            }
            float *pre = sc + (size_t)R * M, *xb = pre + M, *kb = xb + (size_t)M * BLOCK;
            float *qb = kb + (size_t)W * M * BLOCK;
            uint8_t pb[BLOCK];  /* the block's padding bytes */
            for (int n = 0; n < M; n++) pre[n] = scale;
            float *base = scores + (int64_t)bg * M * c * s;  /* head n, row r: base + (n * c + r) * s */
            const uint8_t *pd = pad ? pad + (int64_t)b * pad_stride + s0 : NULL;
            for (int slot = 0; slot < 2; slot++) {
                const float *qs = qt + ((int64_t)bg * 2 + slot) * W * M * T + t0;
                const float *ks = kt ? kt + ((int64_t)bg * 2 + slot) * W * M * S + s0 : NULL;
                const float fill = slot == 0 ? -FLT_MAX : 0.0f;
                for (int r = 0; r < R; r++)
                    for (int w = 0; w < W * M; w++) qb[r * W * M + w] = qs[(int64_t)w * T + r0 + r];
                if (slot == 0)
                    for (int i = 0; i < R * M * VW; i++) mx[i] = -FLT_MAX;
                else
                    for (int r = r0; r < r1; r++)
                        for (int n = 0; n < M; n++)
                            sc[(r - r0) * M + n] =
                                softmax_row(base + ((int64_t)n * c + r) * s, s, mx + ((r - r0) * M + n) * VW);
                for (int j0 = 0; j0 < s; j0 += BLOCK) {
                    /* L keys, Lv rounded up to the vector width: the lanes past L are zero, masked, not written */
                    const int L = s - j0 < BLOCK ? s - j0 : BLOCK, Lv = (L + VW - 1) / VW * VW;
                    if (ks)
                        for (int w = 0; w < W * M; w++)
                            for (int j = 0; j < Lv; j++) kb[w * BLOCK + j] = j < L ? ks[(int64_t)w * S + j0 + j] : 0.0f;
                    if (pd)
                        for (int j = 0; j < Lv; j++) pb[j] = j < L ? pd[j0 + j] : 0;
                    for (int r = r0; r < r1; r++) {
                        const int64_t qpos = qpos0 + r, k0 = kpos0 + j0;
                        /* this row's visible keys in the block, before padding: [lo, hi) */
                        int64_t lo = window > 0 ? qpos - window + 1 - k0 : 0, hi = qpos + 1 - k0;
                        lo = lo < 0 ? 0 : lo;
                        hi = hi > L ? L : hi;
                        if (hi <= lo) { /* the row sees no key of the block */
                            for (int n = 0; n < M; n++) {
                                float *x = base + ((int64_t)n * c + r) * s + j0;
                                for (int j = 0; j < L; j++) x[j] = fill;
                            }
                            continue;
                        }
                        for (int n = 0; n < M; n++) {
                            memcpy(xb + n * BLOCK, base + ((int64_t)n * c + r) * s + j0, sizeof(float) * L);
                            for (int j = L; j < Lv; j++) xb[n * BLOCK + j] = 0.0f;
                        }
                        compose_block(xb, Lv, M, I, qb + (r - r0) * W * M, ks ? kb : NULL,
                                      slot == 0 ? pre : sc + (r - r0) * M, (int)lo, (int)hi, pd ? pb : NULL, fill,
                                      slot == 0 ? mx + (r - r0) * M * VW : NULL);
                        for (int n = 0; n < M; n++)
                            memcpy(base + ((int64_t)n * c + r) * s + j0, xb + n * BLOCK, sizeof(float) * L);
                    }
                }
            }
            free(sc);
            free(mx);
        }
    }
    return failed ? 2 : 0;
}
"""

FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math", "-fopenmp", "-shared", "-fPIC"]

_lock = threading.Lock()
_library = None
_build_error: str | None = None


def compiler() -> str | None:
    """The C compiler the kernel is built with: $CC, else cc, gcc or clang on the PATH."""
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    return None


def cache_dir() -> Path:
    """Where built kernels are kept: $DCFORMER_CACHE, default ~/.cache/dcformer."""
    return Path(os.environ.get("DCFORMER_CACHE", Path.home() / ".cache" / "dcformer"))


def cpu_signature() -> str:
    """What the built code depends on besides its source and flags (-march=native): the CPU model and flags."""
    info = platform.machine() + platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            info += "".join(line for line in f if line.startswith(("model name", "flags")))[:20000]
    except OSError:
        pass
    return info


def build(path: Path, cc: str) -> None:
    """Compile SOURCE into the shared library `path` (written to a temporary name, then renamed: a concurrent
    process never loads a half-written file). A compiler without OpenMP builds it single-threaded; one that does
    not know -march=native builds it for its default target."""
    path.parent.mkdir(parents=True, exist_ok=True)
    no_openmp = [f for f in FLAGS if f != "-fopenmp"]
    attempts = [FLAGS, no_openmp, [f for f in no_openmp if f != "-march=native"]]
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        src = Path(tmp) / "dcmha_kernel.c"
        src.write_text(SOURCE)
        out = Path(tmp) / path.name
        errors = []
        for flags in attempts:
            command = [cc, *flags, str(src), "-o", str(out), "-lm"]
            result = subprocess.run(command, capture_output=True, text=True, check=False)
            if result.returncode == 0:
                os.replace(out, path)
                return
            errors.append(result.stderr)
        raise RuntimeError(f"building the DCMHA CPU kernel with `{cc}` failed:\n{errors[0][-2000:]}")


def load() -> ctypes.CDLL:
    """The kernel's shared library, built on first use. Raises RuntimeError (the reason) where it cannot be
    built; the failure is remembered, so that later calls fail at once."""
    global _library, _build_error
    with _lock:
        if _library is not None:
            return _library
        if _build_error is not None:
            raise RuntimeError(_build_error)
        try:
            cc = compiler()
            if cc is None:
                raise RuntimeError("no C compiler found (set $CC, or install cc/gcc/clang)")
            key = hashlib.sha256("\0".join([SOURCE, cc, *FLAGS, cpu_signature()]).encode()).hexdigest()[:16]
            path = cache_dir() / f"dcmha_kernel_{key}.so"
            if not path.exists():
                logger.info(f"building the DCMHA CPU kernel into {path}")
                build(path, cc)
            library = ctypes.CDLL(str(path))
        except (OSError, RuntimeError, subprocess.SubprocessError) as err:
            _build_error = str(err)
            raise RuntimeError(_build_error) from err
        fn = library.dcmha_chunk
        i32, i64, ptr = ctypes.c_int, ctypes.c_int64, ctypes.c_void_p
        fn.argtypes = [ptr, i32, i32, i32, i32, i32, i32, ptr, i64, i64, ptr, i64, i64, ptr, i64, i64, i64, i64,
                       ctypes.c_float, i32, i32]
        fn.restype = i32
        _library = library
        return library


def available() -> bool:
    """Whether the kernel can run here (it is built, or can be: this builds it)."""
    try:
        load()
        return True
    except RuntimeError:
        return False


def rows_per_tile(num_heads_per_group: int, keys: int, budget_floats: int = 1 << 18) -> int:
    """Query rows per tile: a tile's scores (rows x heads x keys) fill about 1 MiB, one core's L2 cache."""
    return max(1, min(64, budget_floats // max(1, num_heads_per_group * keys)))


# below this many scores a chunk runs on the calling thread: waking the kernel's OpenMP threads (a runtime of its
# own, beside PyTorch's) costs more than a decode step's work, and its spinning threads would contend with PyTorch's
PARALLEL_MIN_SCORES = 1 << 18


_parallel_pid: int | None = None  # the process whose OpenMP threads the kernel has started


def threads_for(num_scores: int) -> int:
    """OpenMP threads for a chunk of `num_scores` scores: PyTorch's intra-op thread count for big chunks, else 1.
    Always 1 in a process forked after the kernel ran in parallel: GNU OpenMP is not fork-safe, and the child
    would wait forever for its parent's threads. (PyTorch's own ops hang there too unless the child sets
    `torch.set_num_threads(1)`: fork before running parallel work, or use the "spawn" start method.)"""
    global _parallel_pid
    threads = torch.get_num_threads() if num_scores >= PARALLEL_MIN_SCORES else 1
    if threads > 1:
        if _parallel_pid is None:
            _parallel_pid = os.getpid()
        elif _parallel_pid != os.getpid():
            return 1
    return threads


def compose_softmax_compose(
    scores: torch.Tensor,
    query_terms: torch.Tensor,
    t0: int,
    key_terms: torch.Tensor | None,
    s0: int,
    key_padding_mask: torch.Tensor | None,
    query_pos0: int,
    key_pos0: int,
    window_size: int | None,
    scale: float,
    rank: int,
    num_groups: int,
) -> torch.Tensor:
    """In place on `scores` ([B, N, c, s] fp32, contiguous, the raw q.k products of one chunk): Compose (of
    `scores * scale`) with the pre slots, mask, softmax, Compose with the post slots, masked keys set to 0.
    query_terms: [B, G, 2, 2I+1, M, T] and key_terms [B, G, 2, 2I+1, M, S] or None (fp32, contiguous, time last;
    the chunk's queries start at index t0, its keys at s0); key_padding_mask: [B, S] bool or None. The chunk's
    query r sits at absolute position query_pos0 + r, its key j at key_pos0 + j. Returns `scores`."""
    library = load()
    B, N, c, s = scores.shape
    G, M = num_groups, N // num_groups
    for name, tensor in (("scores", scores), ("query_terms", query_terms), ("key_terms", key_terms)):
        if tensor is not None and (tensor.dtype != torch.float32 or not tensor.is_contiguous() or tensor.is_cuda):
            raise ValueError(f"the DCMHA CPU kernel takes contiguous float32 CPU tensors; {name} is not")
    if query_terms.shape[:5] != (B, G, 2, 2 * rank + 1, M) or (
        key_terms is not None and key_terms.shape[:5] != query_terms.shape[:5]
    ):
        raise ValueError(
            f"DCMHA CPU kernel: scores {tuple(scores.shape)} do not match the factors {tuple(query_terms.shape)}"
        )
    if rank > MAX_RANK:
        raise ValueError(f"the DCMHA CPU kernel supports dynamic_rank <= {MAX_RANK}, got {rank}")
    pad = None
    if key_padding_mask is not None:
        pad = key_padding_mask.to(torch.uint8).contiguous()
    T, S = query_terms.shape[-1], (key_terms.shape[-1] if key_terms is not None else 0)
    # the C function trusts these bounds: a mistake would read outside the tensors
    if not 0 <= t0 <= T - c:
        raise ValueError(f"DCMHA CPU kernel: queries [{t0}, {t0 + c}) outside the {T} of query_terms")
    if key_terms is not None and not 0 <= s0 <= S - s:
        raise ValueError(f"DCMHA CPU kernel: keys [{s0}, {s0 + s}) outside the {S} of key_terms")
    if pad is not None and (pad.dim() != 2 or pad.shape[0] != B or not 0 <= s0 <= pad.shape[1] - s):
        raise ValueError(
            f"DCMHA CPU kernel: key_padding_mask {tuple(pad.shape)} does not cover batch {B}, keys [{s0}, {s0 + s})"
        )
    err = library.dcmha_chunk(
        scores.data_ptr(), B, G, M, c, s, rank,
        query_terms.data_ptr(), T, t0,
        key_terms.data_ptr() if key_terms is not None else None, S, s0,
        pad.data_ptr() if pad is not None else None, pad.shape[-1] if pad is not None else 0,
        query_pos0, key_pos0, window_size or 0, scale, rows_per_tile(M, s), threads_for(scores.numel()),
    )  # fmt: skip
    if err:
        problem = "out of memory" if err == 2 else f"arguments out of range (rank {rank}, {M} heads per group)"
        raise RuntimeError(f"the DCMHA CPU kernel failed: {problem}")
    return scores
