"""The C++ runtime header every generated CPU kernel starts with.

Small inline helpers only (one translation unit per kernel keeps compiles under a second):

* bf16 / fp16 conversions (bf16 by bit arithmetic with round-to-nearest-even, fp16 through
  the compiler's `_Float16`); low-precision values live in `float` registers, rounded where
  the IR says their dtype is low precision;
* `exp`, `exp2`, `tanh`, `sigmoid` and `erf` for fp32 written with arithmetic and bit
  operations only, so loops that call them still vectorise (the C library's versions are
  scalar calls); `exp` and `exp2` within 1 ulp of the correctly rounded result (subnormal
  results included), `erf` within 1.5 ulp (branch-free: a polynomial below 0.93, `1 - e^q`
  above), `tanh` within a few ulp; IEEE results at ±inf and NaN. No special-case branches
  and no float-to-int conversions of out-of-range values: the rounding to an integer is the
  1.5·2²³ shift, and the final selects replace what falls outside the range;
* horizontal sum, max and min of 16 fp32 lanes (a reduction's partial results) by halving
  steps in vector registers, with max and min propagating NaN;
* PyTorch's semantics where C++ differs: NaN-propagating max/min, floor division and Python
  remainder for integers and floats, shifts past the bit width, integer division by zero
  (0, never a SIGFPE that would kill the process).
"""

HEADER = r"""
#include <stdint.h>
/* no <cmath>: it alone doubles the compile time of a kernel; the compiler's builtins instead */
#define TF_INLINE static inline __attribute__((always_inline))
#define INFINITY __builtin_inff()
#define NAN __builtin_nanf("")
#define TF_MATH1(name) TF_INLINE float tfm_##name(float x) { return __builtin_##name##f(x); } \
  TF_INLINE double tfm_##name(double x) { return __builtin_##name(x); }
#define TF_MATH2(name) TF_INLINE float tfm_##name(float x, float y) { return __builtin_##name##f(x, y); } \
  TF_INLINE double tfm_##name(double x, double y) { return __builtin_##name(x, y); }
#ifdef TF_MVEC
/* glibc's vector math library (libmvec, `toolchain.vector_math`): declared `simd`, these are
   called 8 or 16 lanes at a time in `omp simd` loops (within 4 ulp over the whole range) */
extern "C" __attribute__((simd("notinbranch"))) float sinf(float);
extern "C" __attribute__((simd("notinbranch"))) float cosf(float);
extern "C" __attribute__((simd("notinbranch"))) float logf(float);
#define TF_MATHV(name) TF_INLINE float tfm_##name(float x) { return name##f(x); } \
  TF_INLINE double tfm_##name(double x) { return __builtin_##name(x); }
#else
#define TF_MATHV(name) TF_MATH1(name)
#endif
#ifdef TF_MVEC235
/* glibc 2.35 added these to libmvec */
#define TF_MVECF(name) extern "C" __attribute__((simd("notinbranch"))) float name##f(float); TF_MATHV(name)
#else
#define TF_MVECF(name) TF_MATH1(name)
#endif
TF_MATHV(sin) TF_MATHV(cos) TF_MATHV(log)
TF_MVECF(log2) TF_MVECF(log10) TF_MVECF(log1p) TF_MVECF(expm1) TF_MVECF(tan) TF_MVECF(asin) TF_MVECF(acos)
TF_MVECF(atan) TF_MVECF(sinh) TF_MVECF(cosh) TF_MVECF(asinh) TF_MVECF(acosh) TF_MVECF(atanh)
TF_MATH1(exp) TF_MATH1(exp2) TF_MATH1(sqrt) TF_MATH1(tanh) TF_MATH1(erf)
TF_MATH1(erfc) TF_MATH1(lgamma) TF_MATH1(floor) TF_MATH1(ceil) TF_MATH1(trunc) TF_MATH1(nearbyint) TF_MATH1(fabs)
TF_MATH2(pow) TF_MATH2(fmod) TF_MATH2(atan2) TF_MATH2(copysign)
TF_INLINE float tfm_fma(float a, float b, float c) { return __builtin_fmaf(a, b, c); }

/* ---- low-precision storage ------------------------------------------------------------ */
TF_INLINE float tf_bf16_to_f(uint16_t h) { uint32_t b = (uint32_t)h << 16; float f; __builtin_memcpy(&f, &b, 4); return f; }
TF_INLINE uint16_t tf_f_to_bf16(float f) {
  uint32_t b; __builtin_memcpy(&b, &f, 4);
  uint32_t r = (b + 0x7FFFu + ((b >> 16) & 1u)) >> 16;
  return (f != f) ? (uint16_t)((b >> 16) | 0x40u) : (uint16_t)r;
}
TF_INLINE float tf_round_bf16(float f) { return tf_bf16_to_f(tf_f_to_bf16(f)); }
TF_INLINE float tf_h_to_f(uint16_t h) { _Float16 v; __builtin_memcpy(&v, &h, 2); return (float)v; }
TF_INLINE uint16_t tf_f_to_h(float f) { _Float16 v = (_Float16)f; uint16_t h; __builtin_memcpy(&h, &v, 2); return h; }
TF_INLINE float tf_round_h(float f) { return (float)(_Float16)f; }
TF_INLINE float tf_round_h_d(double f) { return (float)(_Float16)f; }

/* ---- vectorisable fp32 math ----------------------------------------------------------- */
TF_INLINE uint32_t tf_fbits(float f) { uint32_t b; __builtin_memcpy(&b, &f, 4); return b; }
TF_INLINE float tf_bitsf(uint32_t b) { float f; __builtin_memcpy(&f, &b, 4); return f; }
/* 2^n * p for n in [-150, 128] (the exponent field would overflow in one step): two factors */
TF_INLINE float tf_ldexp2(float p, int32_t n) {
  int32_t n1 = n >> 1, n2 = n - n1;
  return p * tf_bitsf((uint32_t)(n1 + 127) << 23) * tf_bitsf((uint32_t)(n2 + 127) << 23);
}
/* x rounded to the nearest integer (|x| < 2^22) by the 1.5 * 2^23 shift, as float and int: no
   float-to-int conversion of out-of-range values (the selects of the callers replace those) */
#define TF_SHIFT 12582912.0f
/* e^s - 1 - s on |s| <= ln2/2 over s^2: minimax, for e^s = 1 + s + s^2 * q(s) */
TF_INLINE float tf_expm1_q(float s) {
  float u = 0.000198527617612853646278381f;
  u = tfm_fma(u, s, 0.00139304355252534151077271f); u = tfm_fma(u, s, 0.00833336077630519866943359f);
  u = tfm_fma(u, s, 0.0416664853692054748535156f); u = tfm_fma(u, s, 0.166666671633720397949219f);
  return tfm_fma(u, s, 0.5f);
}
TF_INLINE float tf_expf(float x) {  /* within 1 ulp, subnormal results included */
  float t = tfm_fma(x, 1.44269504088896341f, TF_SHIFT);
  float n = t - TF_SHIFT;
  int32_t ni = (int32_t)(tf_fbits(t) - tf_fbits(TF_SHIFT));
  float s = tfm_fma(n, -0.693145751953125f, x);
  s = tfm_fma(n, -1.428606765330187045e-06f, s);
  float y = tf_ldexp2(1.0f + tfm_fma(s * s, tf_expm1_q(s), s), ni);
  y = x > 88.72283935546875f ? INFINITY : y;
  return x < -103.97208404541015625f ? 0.0f : y;  /* (NaN stays NaN) */
}
TF_INLINE float tf_exp2f(float x) {  /* within 1 ulp, subnormal results included */
  float t = x + TF_SHIFT;
  float n = t - TF_SHIFT;
  int32_t ni = (int32_t)(tf_fbits(t) - tf_fbits(TF_SHIFT));
  float s = x - n;
  float u = 0.1535920892e-3f;
  u = tfm_fma(u, s, 0.1339262701e-2f); u = tfm_fma(u, s, 0.9618384764e-2f); u = tfm_fma(u, s, 0.5550347269e-1f);
  u = tfm_fma(u, s, 0.2402264476e+0f); u = tfm_fma(u, s, 0.6931471825e+0f); u = tfm_fma(u, s, 1.0f);
  float y = tf_ldexp2(u, ni);
  y = x >= 128.0f ? INFINITY : y;
  return x < -150.0f ? 0.0f : y;
}
TF_INLINE float tf_tanhf(float x) {
  float a = tfm_fabs(x);
  float t = tf_expf(-2.0f * a);
  float big = (1.0f - t) / (1.0f + t);
  float z = a * a;  /* odd Taylor series below 0.55, where 1 - t would cancel */
  float p = -929569.0f / 638512875.0f;
  p = tfm_fma(p, z, 21844.0f / 6081075.0f); p = tfm_fma(p, z, -1382.0f / 155925.0f);
  p = tfm_fma(p, z, 62.0f / 2835.0f); p = tfm_fma(p, z, -17.0f / 315.0f);
  p = tfm_fma(p, z, 2.0f / 15.0f); p = tfm_fma(p, z, -1.0f / 3.0f);
  float small = tfm_fma(p * z, a, a);
  float y = a < 0.55f ? small : big;
  y = a > 9.1f ? 1.0f : y;
  y = tfm_copysign(y, x);
  return x != x ? x : y;
}
TF_INLINE float tf_sigmoidf(float x) { return 1.0f / (1.0f + tf_expf(-x)); }
/* erf within 1.5 ulp, branch-free (both halves evaluated per lane, as vector code does):
   |x| <= 0.9277: x + x * p(x^2); above: 1 - e^q(|x|), q a polynomial clamped at |x| = 4
   (erf is 1.0f from 3.92 on; e^q stays a normal number, so its scaling is one step) */
TF_INLINE float tf_erff(float x) {
  float a = tfm_fabs(x);
  float z = x * x;
  float r = -5.96761703e-4f;
  r = tfm_fma(r, z, 4.99119423e-3f); r = tfm_fma(r, z, -2.67681349e-2f); r = tfm_fma(r, z, 1.12819925e-1f);
  r = tfm_fma(r, z, -3.76125336e-1f); r = tfm_fma(r, z, 1.28379166e-1f);
  float small = tfm_fma(r, a, a);
  float c = a > 4.0f ? 4.0f : a;
  float q = tfm_fma(-1.72853470e-5f, c, 3.83197126e-4f);
  float u = tfm_fma(-3.88396438e-3f, c, 2.42546219e-2f);
  q = tfm_fma(q, c * c, u);
  q = tfm_fma(q, c, -1.06777877e-1f); q = tfm_fma(q, c, -6.34846687e-1f); q = tfm_fma(q, c, -1.28717512e-1f);
  q = tfm_fma(q, c, -c);
  float t = tfm_fma(q, 1.44269504088896341f, TF_SHIFT);
  float n = t - TF_SHIFT;
  float s = tfm_fma(n, -0.693145751953125f, q);
  s = tfm_fma(n, -1.428606765330187045e-06f, s);
  float e = tf_bitsf(tf_fbits(1.0f + tfm_fma(s * s, tf_expm1_q(s), s)) + ((tf_fbits(t) - tf_fbits(TF_SHIFT)) << 23));
  float y = a > 0.927734375f ? 1.0f - e : small;
  return tfm_copysign(y, x);  /* (NaN: small is NaN) */
}

/* ---- horizontal reductions of 16 fp32 lanes: halving steps in vector registers -------- */
typedef float tf_f16v __attribute__((vector_size(64), aligned(4)));
typedef float tf_f8v __attribute__((vector_size(32)));
typedef float tf_f4v __attribute__((vector_size(16)));
typedef float tf_f2v __attribute__((vector_size(8)));
#define TF_HRED16(name, OP) \
  TF_INLINE float name(const float* l) { \
    tf_f16v v; __builtin_memcpy(&v, l, 64); \
    tf_f8v a = OP(__builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7), \
                  __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15)); \
    tf_f4v b = OP(__builtin_shufflevector(a, a, 0, 1, 2, 3), __builtin_shufflevector(a, a, 4, 5, 6, 7)); \
    tf_f2v c = OP(__builtin_shufflevector(b, b, 0, 1), __builtin_shufflevector(b, b, 2, 3)); \
    tf_f2v d = OP(c, __builtin_shufflevector(c, c, 1, 0)); \
    return d[0]; }
#define TF_VADD(x, y) ((x) + (y))
#define TF_VMAX(x, y) (((x) > (y)) | ((x) != (x)) ? (x) : (y))
#define TF_VMIN(x, y) (((x) < (y)) | ((x) != (x)) ? (x) : (y))
TF_HRED16(tf_hsum16f, TF_VADD)
TF_HRED16(tf_hmax16f, TF_VMAX)
TF_HRED16(tf_hmin16f, TF_VMIN)

/* ---- PyTorch semantics ---------------------------------------------------------------- */
/* NaN-propagating max and min, as two selects: in the one-select spelling `(a > b || a != a)`
   GCC 12 merges the NaN test with a caller's select into a select of masks it cannot vectorise
   (a where over maxima kept whole loops scalar, their selects as branches) */
template <class T> TF_INLINE T tf_max(T a, T b) { const T m = a > b ? a : b; return a != a ? a : m; }
template <class T> TF_INLINE T tf_min(T a, T b) { const T m = a < b ? a : b; return a != a ? a : m; }
template <class T> TF_INLINE T tf_imin(T a, T b) { return a < b ? a : b; }
template <class T> TF_INLINE T tf_imax(T a, T b) { return a > b ? a : b; }
/* the columns of a row before the first that a bound mask turns off (`live` of them are in
   range), within [0, n), rounded down to a multiple of `lanes` (a peeled nest: `nests.py`) */
TF_INLINE int64_t tf_clamp_lanes(int64_t live, int64_t n, int64_t lanes) {
  const int64_t w = live < 0 ? 0 : (live > n ? n : live);
  return w - w % lanes;
}
TF_INLINE int64_t tf_min_i64(int64_t a, int64_t b) { return a < b ? a : b; }
/* a signed divisor of -1 (whose quotient of the minimum would overflow); an unsigned type's
   maximum is (T)-1 too, and divides as any other value */
#define TF_MINUS_ONE(T, b) ((T)-1 < (T)0 && (b) == (T)-1)
template <class T> TF_INLINE T tf_floordiv(T a, T b) {
  if (b == 0) return 0;
  if (TF_MINUS_ONE(T, b)) return (T)(0 - a);
  T q = a / b;
  return q - (T)(((a % b) != 0) && ((a < 0) != (b < 0)));
}
template <class T> TF_INLINE T tf_ceildiv(T a, T b) { return -tf_floordiv<T>(-a, b); }
template <class T> TF_INLINE T tf_remainder(T a, T b) {
  if (b == 0 || TF_MINUS_ONE(T, b)) return 0;
  T r = a % b;
  return (r != 0 && ((r < 0) != (b < 0))) ? (T)(r + b) : r;
}
template <class T> TF_INLINE T tf_ifmod(T a, T b) { return (b == 0 || TF_MINUS_ONE(T, b)) ? (T)0 : (T)(a % b); }
template <class T> TF_INLINE T tf_fremainder(T a, T b) {
  T r = tfm_fmod(a, b);
  return (r != 0 && ((r < 0) != (b < 0))) ? r + b : r;
}
template <class T> TF_INLINE T tf_ffloordiv(T a, T b) {
  if (b == 0) return a / b;
  T mod = tfm_fmod(a, b);
  T div = (a - mod) / b;
  if (mod != 0 && ((b < 0) != (mod < 0))) div -= 1;
  T fl;
  if (div != 0) { fl = tfm_floor(div); if (div - fl > (T)0.5) fl += 1; }
  else fl = tfm_copysign((T)0, a / b);
  return fl;
}
template <class T> TF_INLINE T tf_ipow(T a, T b) {
  if (b < 0) return a == 1 ? (T)1 : (a == (T)-1 ? ((b & 1) ? (T)-1 : (T)1) : (T)0);
  T r = 1;
  while (b) { if (b & 1) r = (T)(r * a); a = (T)(a * a); b >>= 1; }
  return r;
}
template <class T, class S> TF_INLINE T tf_shl(T a, S b) { return (b < 0 || b >= (S)(8 * sizeof(T))) ? (T)0 : (T)(a << b); }
template <class T, class S> TF_INLINE T tf_shr(T a, S b) {
  return (b < 0 || b >= (S)(8 * sizeof(T))) ? (T)(a < 0 ? -1 : 0) : (T)(a >> b);
}
/* ir.philox's rand(seed, offset): Philox4x32-10 on the counter (offset, 0, 0) keyed by the seed;
   the first word's top 24 bits times 2^-24 (branch-free, so loops over it vectorise) */
TF_INLINE float tf_philox_uniform(int64_t seed, int64_t offset) {
  uint32_t k0 = (uint32_t)seed, k1 = (uint32_t)((uint64_t)seed >> 32);
  uint32_t c0 = (uint32_t)offset, c1 = (uint32_t)((uint64_t)offset >> 32), c2 = 0, c3 = 0;
  for (int r = 0; r < 10; ++r) {
    uint64_t p0 = (uint64_t)0xD2511F53u * c0, p1 = (uint64_t)0xCD9E8D57u * c2;
    uint32_t n0 = (uint32_t)(p1 >> 32) ^ c1 ^ k0, n2 = (uint32_t)(p0 >> 32) ^ c3 ^ k1;
    c1 = (uint32_t)p1; c3 = (uint32_t)p0; c0 = n0; c2 = n2;
    k0 += 0x9E3779B9u; k1 += 0xBB67AE85u;
  }
  return (float)(c0 >> 8) * 5.9604644775390625e-08f;
}
template <class T> TF_INLINE T tf_sign(T x) { return (T)((T)(x > 0) - (T)(x < 0)); }
"""
