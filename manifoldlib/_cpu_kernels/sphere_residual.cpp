// One-pass CPU kernels for the full-tensor passes of the fused sphere residual
// (manifoldlib/nn/_fused.py has the math). All tensors are contiguous (N, d) rows of one
// floating dtype (float32 or float64); a per-row coefficient is a contiguous tensor of N values.
// The per-row coefficient math stays in Python; these kernels only read and write (N, d) tensors:
//
//   forward_dots(h, f)                -> ((N, 3): [||h||², <h, f>, ||f||²], row factors,
//                                         (N, 3) double [a/q, ν, ||P_h f||²] of nearly parallel rows)  reads h, f
//   forward_combine(h, f, [a, b(, c)], out, parallel?)
//                                        out = a h + b f; a nearly parallel row: c h + b u    reads h, f
//   backward_dots(g, h, f)            -> (N, 2): [<g, h>, <g, f>]              reads g, h, f
//   backward_combine(g, h, f, [c0, c1, c2], [e0, e1, e2], grad_f?, grad_h?)
//       grad_f = c0 g + c1 h + c2 f,  grad_h = e0 g + e1 h + e2 f              reads g, h, f
//
// and, for the built-in angle retractions (gnomonic, Cayley, the p-family θ = p arctan(β/p) with
// the exponential map as p = inf), the whole update row by row, its per-row math in double:
//
//   sphere_step_forward(h, f, s, family, p, eps)  -> (out, stats (N, 3) double: [±q or 0, a, n])  reads h, f
//   sphere_step_backward(g, h, f, stats, s, family, p, eps, want_h, want_f)
//       -> (grad_h, grad_f, dL/ds per row (N,) double)                                 reads g, h, f
//
// (s a one-element tensor, read once per call: a step computed in the graph — exp(log alpha)
// times the damping — stays a tensor under torch.compile; a gradient not asked for comes back as
// an empty tensor). These two are operators with a fake (shape) function and an autograd formula
// (registered from Python by sphere_step.py when the library loads), so torch.compile keeps them
// as opaque calls in its graph.
//
// Each row is read from memory once per direction: its reductions, the per-row coefficients and
// its combination run while the row is in L1 (the separate passes above read every row two or
// three times from memory: the update is bound by memory traffic).
//
// Row dot products accumulate in double whatever the input dtype (a float32 product is exact
// in double), in kLanes independent lanes so that g++ vectorizes the loop without reassociation
// flags; the lanes are summed at the end of each block of kBlock elements. Rows are split across threads. The
// combinations write into outputs the caller allocates (see _fused.py for why).
//
// Rows of tiny or huge norm. The update is homogeneous of degree 1 in (h, f) together (σ, ρ, cos θ
// and k are ratios), its gradients in h and f of degree 0 and in s of degree 1. A row whose
// q = ||h||² (the double sum) falls outside [RowRange<T>::low, RowRange<T>::high] — float32 rows
// of norm outside [2^-24, 2^24], float64 rows outside [2^-200, 2^200] — or whose ||f||² or q ||f||²
// passes 2^2K (RowRange<T>::f_high, K = reach: 48 float32, 400 float64) is therefore computed on
// (h, f) 2^-e by the reference's rule (row_exponent; _fused._reference_factors): 2^e the power of
// two of its largest |h_i|, or a larger one where f 2^-e would pass 2^K. The double sums of a
// float64 row underflow below a norm of about 1e-154 (q clamped at a floor left such rows off their
// sphere, by up to 1e6 in the normalized step), the per-row math of the separate passes runs in
// the input dtype and meets a² ~ ||h||⁴ (and ||h||² ||f||²) far earlier, a float32 row's gradient
// coefficients (about 1/||h||, and ||h|| / ||P_h f||² for f's) leave float32, and a copy scaled by
// its h alone would square an f of 2^520 (float64 h of 2^-250, f of 2^270). The decision is a few
// comparisons per row, taken after the row's first reduction: a row in range runs exactly the code
// it ran before, and only a row out of range pays (it is copied, scaled, while in cache). A power
// of two scales exactly (short of
// subnormal numbers), so a rescaled row gets the bits of its twin in range: its values times
// 2^e, the same gradients in h and f, its dL/ds times 2^e (a row whose own update is out of T's
// range is NaN instead: "Updates out of range" below).
//   - sphere_step_forward redoes such a row on its scaled copy and multiplies the output by 2^e
//     (in double, before rounding); its stats are the scaled row's, q negated to mark the row,
//     and sphere_step_backward then redoes the row's backward on the same scaled copy (combining
//     its f-terms at a power of two of their own, which keeps their coefficients normal: backward_row).
//   - forward_dots returns the scaled row's dots, and as second output the (N,) factors 2^-e
//     (1 for rows in range and those whose e is 0), or an empty tensor when no row was rescaled:
//     the coefficients of A h + B f are ratios of the dots (the same for the scaled row), and the
//     backward's Python math multiplies <g, h>, <g, f> and the coefficients of h and f by 2^-e,
//     dL/ds by 2^e.
// A zero row (outside the contract: its sphere has radius 0) is not rescaled: it is kept, the update
// of a step 0 (_fused.py, "A zero row of h"); the row kernels mark it with q = 0 in its stats, and
// the separate passes return its dots 0, from which their caller knows it (q = 0 nowhere else).
// The exponent e is clamped so that 2^±e are normal numbers of the input dtype, which the separate
// passes multiply in it.
//
// Updates out of range. A nonzero row whose ||P_h f||² (the row's own: a rescaled row's times 2^2e)
// or σ is beyond T's largest number comes out NaN, values and gradients, as on the ATen path, which
// forms both in T (_fused.py, "An update out of range"): the row kernels check both per row (their
// stats' n NaN carries it to the backward); forward_dots gives a rescaled row whose own ||P_h f||² is
// beyond T NaN dots (a row in range shows it in T to the caller, whose math has σ).
//
// Rows nearly parallel (the separate passes). With f nearly parallel to h, ||P_h f||² as
// ||f||² - a²/q (the dots rounded to the input dtype) and the result as A h + B f (in the input
// dtype, B f and B (a/q) h cancelling in their normal part) both lose eps ||f||²/||P_h f||² of
// that dtype (relative), and the row leaves its sphere by the rounding that cancellation exposes.
// forward_dots flags a row whose double sums give
// ||f||² - a²/q < ||f||² 2^-3 (kParallel: cancellation would cost more than 3 bits; one division
// and one comparison per row) and, while the row is in cache, sweeps it once more for
// ||u||² and <h, u> of u = f - (a/q) h in double (on the scaled copy of a rescaled row, as the row
// kernels do): its third output holds [a/q, ν = <h, u>/q, ||u - ν h||²] for such rows (NaN a/q
// for the others), or is empty when no row was flagged. The caller takes ||P_h f||² of those
// rows from it, and forward_combine writes them as c h + b ((f - (a/q) h) - ν h) in double (the
// coefficient c = cos θ as a third coefficient tensor): on the sphere to a few roundings. A call
// without flagged rows runs the code it ran before, and unflagged rows get the bits they got.

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <ATen/ops/ones.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <limits>
#include <mutex>
#include <optional>
#include <tuple>
#include <utility>
#include <vector>

#include "row_kernel.h"  // MANIFOLDLIB_ROW_KERNEL

// The per-row body shared by a row in range and a rescaled one: inlined into the loop over rows
// as the body was before it became a function, so a row in range runs the same code.
#if defined(__GNUC__)
#define MANIFOLDLIB_ALWAYS_INLINE inline __attribute__((always_inline))
#else
#define MANIFOLDLIB_ALWAYS_INLINE inline
#endif

namespace {

constexpr int64_t kLanes = 8;              // double accumulators per dot product
constexpr int64_t kBlock = 256;            // elements summed in fresh lanes before adding them up
constexpr int64_t kGrainElements = 1 << 15;  // elements per parallel task, at least

int64_t grain_rows(int64_t d) { return std::max<int64_t>(1, kGrainElements / std::max<int64_t>(d, 1)); }

double lane_sum(const double* acc) {
  double s = 0.0;
  for (int64_t j = 0; j < kLanes; ++j) s += acc[j];
  return s;
}

// Dot products over one block of at most kBlock elements, added to the row's totals. Summing
// each block in fresh lanes first keeps a lane's chain of roundings short on long rows (about
// kBlock / kLanes + d / kBlock additions instead of d / kLanes).
template <typename T>
MANIFOLDLIB_ROW_KERNEL void block_dots3(const T* x, const T* y, int64_t len, double* total) {
  double xx[kLanes] = {}, xy[kLanes] = {}, yy[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= len; i += kLanes) {
    for (int64_t j = 0; j < kLanes; ++j) {
      const double a = static_cast<double>(x[i + j]);
      const double b = static_cast<double>(y[i + j]);
      xx[j] += a * a;
      xy[j] += a * b;
      yy[j] += b * b;
    }
  }
  double txx = 0.0, txy = 0.0, tyy = 0.0;  // the tail; indexing the lanes here by a variable
  for (; i < len; ++i) {                   // would keep them in memory instead of registers
    const double a = static_cast<double>(x[i]);
    const double b = static_cast<double>(y[i]);
    txx += a * a;
    txy += a * b;
    tyy += b * b;
  }
  total[0] += lane_sum(xx) + txx;
  total[1] += lane_sum(xy) + txy;
  total[2] += lane_sum(yy) + tyy;
}

template <typename T>
MANIFOLDLIB_ROW_KERNEL void block_dots2(const T* g, const T* x, const T* y, int64_t len, double* total) {
  double gx[kLanes] = {}, gy[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= len; i += kLanes) {
    for (int64_t j = 0; j < kLanes; ++j) {
      const double c = static_cast<double>(g[i + j]);
      gx[j] += c * static_cast<double>(x[i + j]);
      gy[j] += c * static_cast<double>(y[i + j]);
    }
  }
  double tgx = 0.0, tgy = 0.0;  // the tail, as in block_dots3
  for (; i < len; ++i) {
    const double c = static_cast<double>(g[i]);
    tgx += c * static_cast<double>(x[i]);
    tgy += c * static_cast<double>(y[i]);
  }
  total[0] += lane_sum(gx) + tgx;
  total[1] += lane_sum(gy) + tgy;
}

// [||u||², <x, u>] of u = y - c x over one block, added to the row's totals (the step's
// ||P_h f||², formed from P_h f itself: the difference ||f||² - <h, f>²/||h||² cancels when f is
// nearly parallel to h; <x, u> is what rounding left of h in u, removed by a second projection).
template <typename T>
MANIFOLDLIB_ROW_KERNEL void block_residual_dots(const T* x, const T* y, double c, int64_t len, double* total) {
  double uu[kLanes] = {}, xu[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= len; i += kLanes) {
    for (int64_t j = 0; j < kLanes; ++j) {
      const double a = static_cast<double>(x[i + j]);
      const double u = static_cast<double>(y[i + j]) - c * a;
      uu[j] += u * u;
      xu[j] += a * u;
    }
  }
  double tuu = 0.0, txu = 0.0;  // the tail, as in block_dots3
  for (; i < len; ++i) {
    const double a = static_cast<double>(x[i]);
    const double u = static_cast<double>(y[i]) - c * a;
    tuu += u * u;
    txu += a * u;
  }
  total[0] += lane_sum(uu) + tuu;
  total[1] += lane_sum(xu) + txu;
}

// The range in which a row is computed as it is; outside it the row is computed rescaled by a
// power of two (see the top of this file). q = ||h||² (summed in double) within [low, high]: the
// per-row math of the separate passes runs in T and forms a² ~ q ||f||², and float64's 2^±400 keeps
// q² and the backward's terms of degree three (a <g, h> ~ q^(3/2)) at least 2^200 inside the range
// of a double. ||f||² and q ||f||² (so a²) at most 2^2K, K = `reach`: past it a row whose h is in
// range (float32 h of norm 2^20 with f of norm 2^46, float64 2^100 with 2^450) overflowed a² in
// the separate passes' math in T and came out off its sphere without an error, and the gradient's
// coefficient of f (of order ||h|| / ||P_h f||²) went subnormal in T. K is the reference's
// (_fused._REFERENCE_RANGE): its rescaled copy's largest |f_i| stays below 2^K.
template <typename T>
struct RowRange;
template <>
struct RowRange<float> {
  static constexpr double low = 0x1p-48, high = 0x1p48, f_high = 0x1p96;
  static constexpr int reach = 48;
};
template <>
struct RowRange<double> {
  static constexpr double low = 0x1p-400, high = 0x1p400, f_high = 0x1p800;
  static constexpr int reach = 400;
};

// dots = [||h||², <h, f>, ||f||²] of a row (double sums): whether it is computed as it is.
template <typename T>
inline bool in_range(const double* dots) {
  return dots[0] >= RowRange<T>::low && dots[0] <= RowRange<T>::high && dots[2] <= RowRange<T>::f_high &&
         dots[0] * dots[2] <= RowRange<T>::f_high;  // false for NaN
}

// The largest |x_i| of a row (NaN entries are passed over: they reach the result through the sums).
template <typename T>
T largest_entry(const T* x, int64_t d) {
  T largest = 0;
  for (int64_t i = 0; i < d; ++i) largest = std::max(largest, std::abs(x[i]));
  return largest;
}

// The exponent e by which a row out of range is rescaled, the rule of the reference
// (_fused._reference_factors): that of the row's largest |h_i| = m 2^e, m in [1/2, 1) (frexp), or
// e_f - K where f 2^-e would pass 2^K (its largest |f_i| = m 2^e_f), so that the copy's squares do
// not overflow where the row's own do not; clamped so that 2^e and 2^-e are normal numbers of T.
// False (not rescaled) for a zero row of h and one with an infinite entry of h; an f with an
// infinite entry, or a zero f, sets no bound.
template <typename T>
MANIFOLDLIB_ROW_KERNEL bool row_exponent(const T* x, const T* y, int64_t d, int* e) {
  const T largest = largest_entry(x, d);
  if (!(largest > 0) || !std::isfinite(largest)) return false;
  std::frexp(static_cast<double>(largest), e);
  const T largest_f = largest_entry(y, d);
  if (largest_f > 0 && std::isfinite(largest_f)) {
    int e_f = 0;
    std::frexp(static_cast<double>(largest_f), &e_f);
    *e = std::max(*e, e_f - RowRange<T>::reach);
  }
  constexpr int bound = std::numeric_limits<T>::max_exponent - 2;  // 126 (float), 1022 (double)
  *e = std::clamp(*e, -bound, bound);
  return true;
}

// out = x 2^-e, exact (short of subnormal results, entries below 2^-126 resp. 2^-1022 of the row's largest)
template <typename T>
void scaled_copy(const T* x, int64_t d, int e, T* out) {
  const double factor = std::ldexp(1.0, -e);
  for (int64_t i = 0; i < d; ++i) out[i] = static_cast<T>(static_cast<double>(x[i]) * factor);
}

// A row is nearly parallel (see the top of this file) when ||y||² - <x, y>²/||x||² from its double
// sums is below ||y||² kParallel: cancellation in the input dtype would cost more than 3 bits.
constexpr double kParallel = 0x1p-3;

inline bool nearly_parallel(const double* dots) {
  return dots[2] - dots[1] * (dots[1] / dots[0]) < kParallel * dots[2];  // false for NaN (x = 0)
}

// [a/q, ν, ||u - ν x||²] of a nearly parallel row, u = y - (a/q) x, ν = <x, u>/q (what rounding
// left of x in u), from one more sweep over the row in double.
template <typename T>
MANIFOLDLIB_ROW_KERNEL void parallel_row(const T* x, const T* y, int64_t d, const double* dots, double* par) {
  const double alpha = dots[1] / dots[0];
  double total[2] = {};
  for (int64_t b = 0; b < d; b += kBlock) block_residual_dots(x + b, y + b, alpha, std::min(kBlock, d - b), total);
  const double normal = total[1] / dots[0];
  par[0] = alpha;
  par[1] = normal;
  par[2] = std::max(total[0] - total[1] * normal, 0.0);
}

// [||x||², <x, y>, ||y||²] of one row; a row out of range: those of (x, y) 2^-e, its factor 2^-e
// returned (1 for a row in range, and for one whose e is 0). A nearly parallel row: its
// [a/q, ν, ||u||²] in par (from the scaled copy), `*parallel` set.
template <typename T>
MANIFOLDLIB_ROW_KERNEL double rescaled_dots3(const T* x, const T* y, int64_t d, double* total, double* par,
                                             bool* parallel) {
  int e = 0;
  if (!row_exponent(x, y, d, &e) || e == 0) {  // a zero or non-finite row, or 2^0: its dots as they are
    if ((*parallel = nearly_parallel(total))) parallel_row(x, y, d, total, par);
    return 1.0;
  }
  std::vector<T> copy(2 * d);
  scaled_copy(x, d, e, copy.data());
  scaled_copy(y, d, e, copy.data() + d);
  total[0] = total[1] = total[2] = 0.0;
  for (int64_t b = 0; b < d; b += kBlock) {
    block_dots3(copy.data() + b, copy.data() + d + b, std::min(kBlock, d - b), total);
  }
  if ((*parallel = nearly_parallel(total))) parallel_row(copy.data(), copy.data() + d, d, total, par);
  // the row's own ||P_h f||² beyond T's range (see the top of this file): NaN dots, so the caller's
  // math gives the row NaN, as the ATen path does; a row in range shows it there in T itself. So
  // does a copy whose h underflowed to 0 (||f|| / ||h|| past about 2^(K + 149) float32, 2^(K + 1074)
  // float64), which the caller would otherwise keep as a zero row.
  const double tangent = *parallel ? par[2] : total[2] - total[1] * (total[1] / total[0]);
  if (!(total[0] > 0.0) || !(std::ldexp(tangent, 2 * e) <= static_cast<double>(std::numeric_limits<T>::max()))) {
    total[0] = total[1] = total[2] = std::numeric_limits<double>::quiet_NaN();
    *parallel = false;
  }
  return std::ldexp(1.0, -e);
}

// [<g, x>, <g, y>] of one row.
template <typename T>
void row_dots2(const T* g, const T* x, const T* y, int64_t d, T* out) {
  double total[2] = {};
  for (int64_t b = 0; b < d; b += kBlock) block_dots2(g + b, x + b, y + b, std::min(kBlock, d - b), total);
  for (int k = 0; k < 2; ++k) out[k] = static_cast<T>(total[k]);
}

void check_rows(const at::Tensor& t, const char* name, const at::Tensor& like) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor, got ", t.device());
  TORCH_CHECK(t.dim() == 2, name, " must have shape (N, d), got ", t.sizes());
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
  TORCH_CHECK(t.scalar_type() == like.scalar_type(), name, " must have dtype ", like.scalar_type(),
              ", got ", t.scalar_type());
  TORCH_CHECK(t.sizes() == like.sizes(), name, " must have shape ", like.sizes(), ", got ", t.sizes());
}

// k per-row coefficients: contiguous tensors of N values each (e.g. (..., 1) with N rows).
void check_coefs(at::TensorList c, const char* name, const at::Tensor& like, size_t k) {
  TORCH_CHECK(c.size() == k, name, " must hold ", k, " coefficient tensors, got ", c.size());
  for (const at::Tensor& t : c) {
    TORCH_CHECK(t.device().is_cpu() && t.is_contiguous() && t.scalar_type() == like.scalar_type(),
                name, " must hold contiguous CPU tensors of dtype ", like.scalar_type());
    TORCH_CHECK(t.numel() == like.size(0), name, " must hold tensors of ", like.size(0),
                " values (one per row), got shape ", t.sizes());
  }
}

void check_dtype(const at::Tensor& t) {
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kDouble,
              "sphere residual kernels take float32 or float64, got ", t.scalar_type());
}

// The dots of the rows, the rows' factors 2^-e: an (N,) tensor if any row was rescaled (1 for the
// others), else an empty one, and the [a/q, ν, ||P_h f||²] of the nearly parallel rows: an (N, 3)
// double tensor if any row was flagged (NaN a/q for the others), else an empty one (see the top of
// this file). The rescaled and flagged rows are collected under a lock that a call whose rows are
// all in range and not nearly parallel never takes.
std::tuple<at::Tensor, at::Tensor, at::Tensor> forward_dots(const at::Tensor& h, const at::Tensor& f) {
  check_dtype(h);
  check_rows(h, "h", h);
  check_rows(f, "f", h);
  const int64_t n = h.size(0), d = h.size(1);
  at::Tensor out = at::empty({n, 3}, h.options());
  std::mutex lock;
  std::vector<std::pair<int64_t, double>> rescaled;                // (row, 2^-e)
  std::vector<std::pair<int64_t, std::array<double, 3>>> flagged;  // (row, [a/q, ν, ||u||²])
  AT_DISPATCH_FLOATING_TYPES(h.scalar_type(), "forward_dots", [&] {
    const scalar_t* hp = h.const_data_ptr<scalar_t>();
    const scalar_t* fp = f.const_data_ptr<scalar_t>();
    scalar_t* op = out.mutable_data_ptr<scalar_t>();
    at::parallel_for(0, n, grain_rows(d), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const scalar_t* x = hp + r * d;
        const scalar_t* y = fp + r * d;
        double total[3] = {};
        for (int64_t b = 0; b < d; b += kBlock) block_dots3(x + b, y + b, std::min(kBlock, d - b), total);
        std::array<double, 3> par;
        bool parallel = false;
        if (!in_range<scalar_t>(total)) {
          const double factor = rescaled_dots3(x, y, d, total, par.data(), &parallel);
          if (factor != 1.0) {
            std::lock_guard<std::mutex> guard(lock);
            rescaled.emplace_back(r, factor);
          }
        } else if (nearly_parallel(total)) {
          parallel_row(x, y, d, total, par.data());
          parallel = true;
        }
        if (parallel) {
          std::lock_guard<std::mutex> guard(lock);
          flagged.emplace_back(r, par);
        }
        for (int k = 0; k < 3; ++k) op[3 * r + k] = static_cast<scalar_t>(total[k]);
      }
    });
  });
  at::Tensor factors = at::empty({0}, h.options());
  if (!rescaled.empty()) {
    factors = at::ones({n}, h.options());
    AT_DISPATCH_FLOATING_TYPES(h.scalar_type(), "forward_dots_factors", [&] {
      scalar_t* fp = factors.mutable_data_ptr<scalar_t>();
      for (const auto& [r, factor] : rescaled) fp[r] = static_cast<scalar_t>(factor);
    });
  }
  at::Tensor parallel = at::empty({0}, h.options().dtype(at::kDouble));
  if (!flagged.empty()) {
    parallel = at::full({n, 3}, std::numeric_limits<double>::quiet_NaN(), h.options().dtype(at::kDouble));
    double* pp = parallel.mutable_data_ptr<double>();
    for (const auto& [r, par] : flagged) std::copy(par.begin(), par.end(), pp + 3 * r);
  }
  return {out, factors, parallel};
}

// out = a h + b f row by row; with `parallel` (forward_dots' third output, not empty) the rows it
// flags (a/q not NaN) are written as c h + b ((f - (a/q) h) - ν h) in double instead, c the third
// coefficient tensor.
template <typename T>
inline void combine2(T a, T b, const T* x, const T* y, int64_t d, T* o) {
  for (int64_t i = 0; i < d; ++i) o[i] = a * x[i] + b * y[i];
}

template <typename T>
MANIFOLDLIB_ROW_KERNEL void combine_parallel_row(double c, double b, const double* par, const T* x, const T* y,
                                                 int64_t d, T* o) {
  const double alpha = par[0], normal = par[1];
  for (int64_t i = 0; i < d; ++i) {
    const double xi = static_cast<double>(x[i]);
    const double u = (static_cast<double>(y[i]) - alpha * xi) - normal * xi;
    o[i] = static_cast<T>(c * xi + b * u);
  }
}

void forward_combine(const at::Tensor& h, const at::Tensor& f, at::TensorList coef, const at::Tensor& out,
                     const std::optional<at::Tensor>& parallel) {
  check_dtype(h);
  check_rows(h, "h", h);
  check_rows(f, "f", h);
  const bool with_parallel = parallel.has_value() && parallel->defined() && parallel->numel() > 0;
  check_coefs(coef, "coef", h, with_parallel ? 3 : 2);
  check_rows(out, "out", h);
  const int64_t n = h.size(0), d = h.size(1);
  if (with_parallel) {
    TORCH_CHECK(parallel->scalar_type() == at::kDouble && parallel->is_contiguous() && parallel->dim() == 2 &&
                    parallel->size(0) == n && parallel->size(1) == 3,
                "forward_combine: parallel must be forward_dots' contiguous (N, 3) float64 tensor");
  }
  AT_DISPATCH_FLOATING_TYPES(h.scalar_type(), "forward_combine", [&] {
    const scalar_t* hp = h.const_data_ptr<scalar_t>();
    const scalar_t* fp = f.const_data_ptr<scalar_t>();
    const scalar_t* ap = coef[0].const_data_ptr<scalar_t>();
    const scalar_t* bp = coef[1].const_data_ptr<scalar_t>();
    scalar_t* op = out.mutable_data_ptr<scalar_t>();
    if (!with_parallel) {
      at::parallel_for(0, n, grain_rows(d), [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r) combine2(ap[r], bp[r], hp + r * d, fp + r * d, d, op + r * d);
      });
      return;
    }
    const scalar_t* cp = coef[2].const_data_ptr<scalar_t>();
    const double* pp = parallel->const_data_ptr<double>();
    at::parallel_for(0, n, grain_rows(d), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        if (std::isnan(pp[3 * r])) {
          combine2(ap[r], bp[r], hp + r * d, fp + r * d, d, op + r * d);
        } else {
          combine_parallel_row(static_cast<double>(cp[r]), static_cast<double>(bp[r]), pp + 3 * r, hp + r * d,
                               fp + r * d, d, op + r * d);
        }
      }
    });
  });
}

at::Tensor backward_dots(const at::Tensor& g, const at::Tensor& h, const at::Tensor& f) {
  check_dtype(h);
  check_rows(h, "h", h);
  check_rows(f, "f", h);
  check_rows(g, "grad", h);
  const int64_t n = h.size(0), d = h.size(1);
  at::Tensor out = at::empty({n, 2}, h.options());
  AT_DISPATCH_FLOATING_TYPES(h.scalar_type(), "backward_dots", [&] {
    const scalar_t* gp = g.const_data_ptr<scalar_t>();
    const scalar_t* hp = h.const_data_ptr<scalar_t>();
    const scalar_t* fp = f.const_data_ptr<scalar_t>();
    scalar_t* op = out.mutable_data_ptr<scalar_t>();
    at::parallel_for(0, n, grain_rows(d), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) row_dots2(gp + r * d, hp + r * d, fp + r * d, d, op + 2 * r);
    });
  });
  return out;
}

template <typename T>
void combine3(const T* g, const T* x, const T* y, T a, T b, T c, int64_t d, T* o) {
  for (int64_t i = 0; i < d; ++i) o[i] = a * g[i] + b * x[i] + c * y[i];
}

template <typename T>
void combine3x2(const T* g, const T* x, const T* y, const T* c, const T* e, int64_t d, T* o1, T* o2) {
  // the coefficients in locals: the outputs could alias c and e for all the compiler knows, and it
  // would reload them in every iteration instead of vectorizing the loop
  const T c0 = c[0], c1 = c[1], c2 = c[2], e0 = e[0], e1 = e[1], e2 = e[2];
  for (int64_t i = 0; i < d; ++i) {
    const T gi = g[i], xi = x[i], yi = y[i];
    o1[i] = c0 * gi + c1 * xi + c2 * yi;
    o2[i] = e0 * gi + e1 * xi + e2 * yi;
  }
}

void backward_combine(const at::Tensor& g, const at::Tensor& h, const at::Tensor& f, at::TensorList coef_f,
                      at::TensorList coef_h, const std::optional<at::Tensor>& grad_f,
                      const std::optional<at::Tensor>& grad_h) {
  check_dtype(h);
  check_rows(h, "h", h);
  check_rows(f, "f", h);
  check_rows(g, "grad", h);
  const bool want_f = grad_f.has_value() && grad_f->defined();
  const bool want_h = grad_h.has_value() && grad_h->defined();
  if (want_f) {
    check_rows(*grad_f, "grad_f", h);
    check_coefs(coef_f, "coef_f", h, 3);
  }
  if (want_h) {
    check_rows(*grad_h, "grad_h", h);
    check_coefs(coef_h, "coef_h", h, 3);
  }
  const int64_t n = h.size(0), d = h.size(1);
  AT_DISPATCH_FLOATING_TYPES(h.scalar_type(), "backward_combine", [&] {
    const scalar_t* gp = g.const_data_ptr<scalar_t>();
    const scalar_t* hp = h.const_data_ptr<scalar_t>();
    const scalar_t* fp = f.const_data_ptr<scalar_t>();
    const scalar_t* cf[3] = {};
    const scalar_t* ch[3] = {};
    for (int k = 0; k < 3; ++k) {
      if (want_f) cf[k] = coef_f[k].const_data_ptr<scalar_t>();
      if (want_h) ch[k] = coef_h[k].const_data_ptr<scalar_t>();
    }
    scalar_t* ofp = want_f ? grad_f->mutable_data_ptr<scalar_t>() : nullptr;
    scalar_t* ohp = want_h ? grad_h->mutable_data_ptr<scalar_t>() : nullptr;
    at::parallel_for(0, n, grain_rows(d), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const int64_t o = r * d;
        // grad_f = c0 g + c1 h + c2 f, grad_h = e0 g + e1 h + e2 f
        if (want_f && want_h) {
          const scalar_t c[3] = {cf[0][r], cf[1][r], cf[2][r]};
          const scalar_t e[3] = {ch[0][r], ch[1][r], ch[2][r]};
          combine3x2(gp + o, hp + o, fp + o, c, e, d, ofp + o, ohp + o);
        } else if (want_f) {
          combine3(gp + o, hp + o, fp + o, cf[0][r], cf[1][r], cf[2][r], d, ofp + o);
        } else if (want_h) {
          combine3(gp + o, hp + o, fp + o, ch[0][r], ch[1][r], ch[2][r], d, ohp + o);
        }
      }
    });
  });
}

// ---- the row-fused update for closed-form retractions (manifoldlib/nn/_fused.py has the math) ----

constexpr int64_t kGnomonic = 0;  // θ = arctan β:      cos θ = k = (1 + σ)^(-1/2)
constexpr int64_t kCayley = 1;    // θ = 2 arctan(β/2): k = 1/(1 + σ/4), cos θ = (1 - σ/4) k
constexpr int64_t kP = 2;         // θ = p arctan(β/p), p in (0, inf] (inf: the exponential map)
// below this σ (and σ/p²) the p-family's k'(σ) = (cos θ/(1 + z²) - k)/(2σ) cancels: its series instead
constexpr double kSeriesSigma = 1e-5;

struct RowStep {
  double rho;   // the normalized step's factor (1 for the literal step)
  double step;  // s rho
  double sigma, c, k;
  double z_sq;  // σ/p² (p-family)
};

inline RowStep row_step(double q, double n, double s, int64_t family, double p, double eps) {
  RowStep r{1.0, s, 0.0, 0.0, 0.0, 0.0};
  if (eps > 0.0) {
    // σ = (s rho)² n/q from the ratio n/D: (s rho)² and q/D are of order ||h||²/||P_h f||², below a
    // double's normal range for float64 rows with ||P_h f|| / ||h|| past 2^511 (_fused.py)
    const double denominator = n + eps * eps * q;  // D = ||P_h f||² + eps² r²
    r.rho = std::sqrt(q) / std::sqrt(denominator);  // r / sqrt(D)
    r.step = s * r.rho;
    r.sigma = s * s * (n / denominator);
  } else {
    r.sigma = s * s * n / q;
  }
  if (family == kGnomonic) {
    r.c = r.k = 1.0 / std::sqrt(1.0 + r.sigma);
  } else if (family == kCayley) {
    r.k = 1.0 / (1.0 + 0.25 * r.sigma);
    r.c = (1.0 - 0.25 * r.sigma) * r.k;
  } else {
    const double beta = std::sqrt(r.sigma);
    const double theta = std::isinf(p) ? beta : p * std::atan(beta / p);
    r.z_sq = std::isinf(p) ? 0.0 : r.sigma / (p * p);
    r.c = std::cos(theta);
    r.k = beta > 0.0 ? std::sin(theta) / beta : 1.0;
  }
  return r;
}

// g_sigma = cos θ'(σ) g_c + k'(σ) g_k
inline double coefficients_vjp(const RowStep& r, int64_t family, double p, double grad_cos, double grad_k) {
  if (family == kGnomonic) return -0.5 * r.c * r.c * r.c * (grad_cos + grad_k);
  if (family == kCayley) return -0.25 * r.k * r.k * (2.0 * grad_cos + grad_k);
  // θ'(σ) = 1/(2β(1 + z²)): cos θ' = -k/(2(1 + z²)), k' = (cos θ/(1 + z²) - k)/(2σ), whose series
  // is k1 + 2 k2 σ with k1 = -(1/6 + 1/(3p²)), k2 = 1/120 + 1/(6p²) + 1/(5p⁴)
  const double inv_p_sq = std::isinf(p) ? 0.0 : 1.0 / (p * p);
  const double one_z = 1.0 + r.z_sq;
  double dk;
  if (std::max(r.sigma, r.z_sq) < kSeriesSigma) {  // σ and z² = σ/p² small (its terms go as 1/p^2k)
    const double k1 = -(1.0 / 6.0 + inv_p_sq / 3.0);
    const double k2 = 1.0 / 120.0 + inv_p_sq / 6.0 + inv_p_sq * inv_p_sq / 5.0;
    dk = k1 + 2.0 * k2 * r.sigma;
  } else {
    dk = (r.c / one_z - r.k) / (2.0 * r.sigma);
  }
  return -r.k / (2.0 * one_z) * grad_cos + dk * grad_k;
}

// 1 + z², z = β/p (gnomonic p = 1, Cayley p = 2, the exponential map p = inf: 1): θ'(β) = 1/(1 + z²),
// so d(k t)/dt = cos θ θ'(β) = c/(1 + z²) (gnomonic c³, Cayley c k, the exponential map c) and
// 2 cos θ'(σ) = -k/(1 + z²) for the step t (σ = t² n/q, k t = sin θ / sqrt(n/q)).
inline double one_plus_z_sq(const RowStep& r, int64_t family) {
  if (family == kGnomonic) return 1.0 + r.sigma;
  if (family == kCayley) return 1.0 + 0.25 * r.sigma;
  return 1.0 + r.z_sq;
}

// The step s: a one-element CPU tensor of the rows' dtype (SphereResidual's exp(log alpha) times its
// damping, computed in the graph under torch.compile), read as the double of its value.
double step_value(const at::Tensor& step) {
  TORCH_CHECK(step.device().is_cpu() && step.numel() == 1,
              "sphere_step kernels: s must be a one-element CPU tensor, got shape ", step.sizes(), " on ",
              step.device());
  return step.item<double>();
}

void check_family(int64_t family, double p) {
  TORCH_CHECK(family == kGnomonic || family == kCayley || family == kP,
              "sphere_step kernels: family must be 0 (gnomonic), 1 (Cayley) or 2 (p-family), got ", family);
  TORCH_CHECK(family != kP || p > 0.0, "sphere_step kernels: p must be in (0, inf], got ", p);
}

// Whether a row's update is within T's range (see the top of this file): its ||P_h f||² (of the row
// as given) and σ at most T's largest number. False for NaN.
template <typename T>
inline bool update_in_range(double tangent, double sigma) {
  constexpr double largest = static_cast<double>(std::numeric_limits<T>::max());
  return tangent <= largest && sigma <= largest;
}

// One row of sphere_step_forward after its first reduction (dots = [||x||², <x, y>, ||y||²]): its
// ||P_h f||², coefficients and output, and its stats [q, a, n]. kRescaled: (x, y) are the row's
// scaled copy and the output is multiplied by 2^e before it is rounded to T. A row whose update is
// out of T's range comes out NaN, its stats' n NaN (so its backward is NaN too).
template <typename T, bool kRescaled>
MANIFOLDLIB_ALWAYS_INLINE void forward_row(const T* x, const T* y, int64_t d, const double* dots, double s,
                                           int64_t family, double p, double eps, int e, T* o,
                                           double* stats) {
  const double q = dots[0], a = dots[1];
  // ||P_h f||² from P_h f itself, for both step forms (the difference form
  // ||f||² - <h, f>²/||h||² cancels for f nearly parallel to h)
  double total[2] = {};
  for (int64_t b = 0; b < d; b += kBlock) {
    block_residual_dots(x + b, y + b, a / q, std::min(kBlock, d - b), total);
  }
  const double normal = total[1] / q;  // the part of h that rounding left in u = f - (a/q) h
  double tangent = std::max(total[0] - total[1] * normal, 0.0);  // ||u - normal h||²
  RowStep st = row_step(q, tangent, s, family, p, eps);
  // the row's own ||P_h f||²: a rescaled row's times 2^2e (ldexp: inf past a double's range)
  const double own_tangent = kRescaled ? std::ldexp(tangent, 2 * e) : tangent;
  if (!update_in_range<T>(own_tangent, st.sigma)) {  // NaN, as on the ATen path
    tangent = std::numeric_limits<double>::quiet_NaN();
    st = row_step(q, tangent, s, family, p, eps);  // cos θ NaN: every entry of the row NaN
  }
  const double ks = st.k * st.step;
  // c h + ks u in double, from u itself, projected twice: the result keeps the norm of h
  // to rounding. Formed as A h + B f in the input dtype, B f and B (a/q) h would cancel
  // in their normal part: for f nearly parallel to h the norm would drift by the rounding
  // of B f's normal part, of order eps_T ||f|| / ||h|| relative (eps_T the input dtype's
  // epsilon), which the normalized step's rho (up to 1/eps) magnifies further.
  const double alpha = a / q;
  const double up = kRescaled ? std::ldexp(1.0, e) : 1.0;
  for (int64_t i = 0; i < d; ++i) {
    const double xi = static_cast<double>(x[i]);
    const double u = (static_cast<double>(y[i]) - alpha * xi) - normal * xi;
    if constexpr (kRescaled) {
      o[i] = static_cast<T>((st.c * xi + ks * u) * up);
    } else {
      o[i] = static_cast<T>(st.c * xi + ks * u);
    }
  }
  stats[0] = q;
  stats[1] = a;
  stats[2] = tangent;
}

// A zero row, kept (_fused.py, "A zero row of h"): the update of a step 0, whose tangent space is
// {0}: P_0 f = 0, so cos θ = k = 1 and out = h; its stats [0, a, a], q = 0 the mark. a = <0, f>
// (the row's double sum) is 0, or NaN where f has a non-finite entry: then the row is NaN, its
// output, its gradients and its dL/ds, as any row with a non-finite input. No square of f is
// formed: ||f||² overflows a double for float64 rows of entries past 1e154, and a step 0 times inf
// is NaN.
template <typename T>
void forward_zero_row(const T* x, int64_t d, double a, T* o, double* stats) {
  for (int64_t i = 0; i < d; ++i) o[i] = static_cast<T>(static_cast<double>(x[i]) + a);
  stats[0] = 0.0;
  stats[1] = stats[2] = a;
}

// A row of sphere_step_forward out of range (see the top of this file): computed on its copy scaled
// by 2^-e (e = 0 too: the backward then combines its f-terms as a rescaled row's), its output times
// 2^e, its stats the scaled row's with q negated (the mark the backward reads). A row with a
// non-finite entry of h is computed as it is (NaN); a zero row is kept; a copy whose h underflowed
// to 0 (||f|| / ||h|| past about 2^(K + 149) float32, 2^(K + 1074) float64) comes out NaN, values
// and gradients.
template <typename T>
MANIFOLDLIB_ROW_KERNEL void forward_rescaled_row(const T* x, const T* y, int64_t d, const double* dots, double s,
                                                 int64_t family, double p, double eps, T* o, double* stats) {
  int e = 0;
  if (!row_exponent(x, y, d, &e)) {
    if (dots[0] == 0.0) {
      forward_zero_row(x, d, dots[1], o, stats);
      return;
    }
    forward_row<T, false>(x, y, d, dots, s, family, p, eps, 0, o, stats);
    return;
  }
  std::vector<T> copy(2 * d);
  const T* xs = copy.data();
  const T* ys = copy.data() + d;
  scaled_copy(x, d, e, copy.data());
  scaled_copy(y, d, e, copy.data() + d);
  double scaled[3] = {};
  for (int64_t b = 0; b < d; b += kBlock) block_dots3(xs + b, ys + b, std::min(kBlock, d - b), scaled);
  if (!(scaled[0] > 0.0)) {  // q 1 (the mark stays negative), a and n NaN: the row NaN
    scaled[0] = 1.0;
    scaled[1] = scaled[2] = std::numeric_limits<double>::quiet_NaN();
  }
  forward_row<T, true>(xs, ys, d, scaled, s, family, p, eps, e, o, stats);
  stats[0] = -stats[0];
}

std::tuple<at::Tensor, at::Tensor> sphere_step_forward(const at::Tensor& h, const at::Tensor& f,
                                                       const at::Tensor& step, int64_t family, double p,
                                                       double eps) {
  check_dtype(h);
  check_rows(h, "h", h);
  check_rows(f, "f", h);
  check_family(family, p);
  const double s = step_value(step);
  const int64_t n = h.size(0), d = h.size(1);
  at::Tensor out = at::empty({n, d}, h.options());
  at::Tensor stats = at::empty({n, 3}, h.options().dtype(at::kDouble));
  AT_DISPATCH_FLOATING_TYPES(h.scalar_type(), "sphere_step_forward", [&] {
    const scalar_t* hp = h.const_data_ptr<scalar_t>();
    const scalar_t* fp = f.const_data_ptr<scalar_t>();
    scalar_t* op = out.mutable_data_ptr<scalar_t>();
    double* sp = stats.mutable_data_ptr<double>();
    at::parallel_for(0, n, grain_rows(d), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const scalar_t* x = hp + r * d;
        const scalar_t* y = fp + r * d;
        double dots[3] = {};  // ||h||², <h, f>, ||f||²
        for (int64_t b = 0; b < d; b += kBlock) block_dots3(x + b, y + b, std::min(kBlock, d - b), dots);
        if (in_range<scalar_t>(dots)) {
          forward_row<scalar_t, false>(x, y, d, dots, s, family, p, eps, 0, op + r * d, sp + 3 * r);
        } else {
          forward_rescaled_row(x, y, d, dots, s, family, p, eps, op + r * d, sp + 3 * r);
        }
      }
    });
  });
  return {out, stats};
}

// One row of sphere_step_backward, from its stats [q, a, n]: writes its gradients in h and f (those
// asked for) and returns its dL/ds. (x, y) are the row of (h, f) the stats belong to: for a
// rescaled row its scaled copy, whose gradients in h and f are the row's own (degree 0).
// grad_f = c[0] g + c[1] h + c[2] f and grad_h = e[0] g + e[1] h + e[2] f, whichever are asked for
// (a null output is not wanted), in one pass over the row where both are.
template <typename T>
MANIFOLDLIB_ALWAYS_INLINE void combine_gradients(const T* g, const T* x, const T* y, const T* c, const T* e,
                                                 int64_t d, T* gf, T* gh) {
  if (gf != nullptr && gh != nullptr) {
    combine3x2(g, x, y, c, e, d, gf, gh);
  } else if (gf != nullptr) {
    combine3(g, x, y, c[0], c[1], c[2], d, gf);
  } else if (gh != nullptr) {
    combine3(g, x, y, e[0], e[1], e[2], d, gh);
  }
}

// kRescaled: (x, y) are the row's scaled copy, 2^-e times the row (h, f_own), and f_terms receives
// the f that the gradients' f-terms combine (it may be y's buffer: y is read before).
template <typename T, bool kRescaled>
MANIFOLDLIB_ALWAYS_INLINE double backward_row(const T* g, const T* x, const T* y, int64_t d, double q, double a,
                                              double tangent, double s, int64_t family, double p, double eps,
                                              T* gf, T* gh, T* f_terms = nullptr, const T* f_own = nullptr,
                                              int e = 0) {
  double dots[2] = {};  // <g, h>, <g, f>
  for (int64_t b = 0; b < d; b += kBlock) {
    block_dots2(g + b, x + b, y + b, std::min(kBlock, d - b), dots);
  }
  const RowStep st = row_step(q, tangent, s, family, p, eps);
  const double along = a / q;
  const double g_h = dots[0], g_u = dots[1] - along * g_h;  // <g, h>, <g, P_h f>
  const double g_sigma = coefficients_vjp(st, family, p, g_h, st.step * g_u);
  const double ks = st.k * st.step;
  // grouped as in _fused.py: no product smaller than the coefficient it forms, nor (a/q)²
  const double mu = 2.0 * (g_sigma / q) * st.step * st.step;
  double t = mu * along + ks * (g_h / q);
  // dL/d(s rho) = d(k t)/dt <g, u> + 2 cos θ'(σ) (t n/q) <g, h>, t = s rho, in closed form
  // (one_plus_z_sq): as k <g, u> + 2 g_σ t n/q it holds k + 2σ k'(σ), whose terms cancel to
  // c/(1 + z²) (gnomonic: k ~ 1/β, the sum ~ 1/β³) and lose β eps relative at a long step
  const double one_z = one_plus_z_sq(st, family);
  const double g_step = (st.c * g_u - st.k * g_h * ((st.step / q) * tangent)) / one_z;
  const double coef_g = st.c - ks * along;
  double coef_h = (mu * along + 2.0 * ks * (g_h / q)) * along - 2.0 * g_sigma * st.sigma / q;
  double mu_f = mu;
  if (eps > 0.0) {  // s rho depends on h and f through ||P_h f||² and ||h||²
    const double denominator = tangent + eps * eps * q;
    const double w = g_step * st.step / denominator;
    const double w_along = w * along;
    mu_f = mu - w;
    t -= w_along;
    coef_h += -w_along * along + g_step * st.step * (1.0 / q - eps * eps / denominator);
  }
  double t_f = t;  // t as the coefficient of f
  if constexpr (kRescaled) {
    // The f-terms as (coefficient 2^-j) (f_own 2^(j-e)), the larger coefficient in [1/2, 1): the
    // same products (powers of two are exact), but the copy's coefficient of f in grad_f, of order
    // ||g|| ||h|| / ||P_h f||² at the copy's scale (2^e times the row's own for a tiny row), would
    // leave T's normal range where the terms themselves are normal.
    int j = 0;
    const double largest = std::max(std::abs(mu_f), std::abs(t));
    if (largest > 0.0 && std::isfinite(largest)) std::frexp(largest, &j);
    mu_f = std::ldexp(mu_f, -j);
    t_f = std::ldexp(t, -j);
    for (int64_t i = 0; i < d; ++i) f_terms[i] = static_cast<T>(std::ldexp(static_cast<double>(f_own[i]), j - e));
    y = f_terms;
  }
  const T c[3] = {static_cast<T>(ks), static_cast<T>(-t), static_cast<T>(mu_f)};
  const T e_coef[3] = {static_cast<T>(coef_g), static_cast<T>(coef_h), static_cast<T>(-t_f)};
  // grad_f = ks g - t h + mu_f f,  grad_h = coef_g g + coef_h h - t f
  combine_gradients(g, x, y, c, e_coef, d, gf, gh);
  return g_step * st.rho;  // d(s rho)/ds = rho
}

// A zero row's backward, the gradients of a step 0: grad_h = 1 g + 0 h + 0 f, grad_f = 0 g + 0 h + 0 f,
// dL/ds 0, each plus the row's a from its stats (0, or NaN: forward_zero_row); without <g, f>,
// which may overflow (P_0 f = 0: it does not enter).
template <typename T>
double backward_zero_row(const T* g, const T* x, const T* y, int64_t d, double a, T* gf, T* gh) {
  const T nan_or_0 = static_cast<T>(a);
  const T c[3] = {nan_or_0, nan_or_0, nan_or_0};         // of g, h, f in grad_f
  const T e[3] = {T(1) + nan_or_0, nan_or_0, nan_or_0};  // of g, h, f in grad_h
  combine_gradients(g, x, y, c, e, d, gf, gh);
  return a;
}

// A row the forward rescaled (q < 0 in its stats): its backward on the same scaled copy (the same
// e, from the same row); its gradients in h and f as they come (the f-terms on f rescaled once more,
// see backward_row), its dL/ds times 2^e.
template <typename T>
MANIFOLDLIB_ROW_KERNEL double backward_rescaled_row(const T* g, const T* x, const T* y, int64_t d,
                                                    const double* stats, double s, int64_t family, double p,
                                                    double eps, T* gf, T* gh) {
  int e = 0;
  row_exponent(x, y, d, &e);  // true: the forward rescaled the row
  std::vector<T> copy(2 * d);
  scaled_copy(x, d, e, copy.data());
  scaled_copy(y, d, e, copy.data() + d);
  const double per_row = backward_row<T, true>(g, copy.data(), copy.data() + d, d, -stats[0], stats[1], stats[2],
                                               s, family, p, eps, gf, gh, copy.data() + d, y, e);
  return per_row * std::ldexp(1.0, e);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> sphere_step_backward(const at::Tensor& g, const at::Tensor& h,
                                                                    const at::Tensor& f, const at::Tensor& stats,
                                                                    const at::Tensor& step, int64_t family,
                                                                    double p, double eps, bool want_h,
                                                                    bool want_f) {
  check_dtype(h);
  check_rows(h, "h", h);
  check_rows(f, "f", h);
  check_rows(g, "grad", h);
  check_family(family, p);
  const double s = step_value(step);
  const int64_t n = h.size(0), d = h.size(1);
  TORCH_CHECK(stats.scalar_type() == at::kDouble && stats.is_contiguous() && stats.dim() == 2 &&
                  stats.size(0) == n && stats.size(1) == 3,
              "sphere_step_backward: stats must be the forward's contiguous (N, 3) float64 tensor");
  // a gradient not asked for: an empty tensor (an operator's output is a tensor, also under tracing)
  at::Tensor grad_h = want_h ? at::empty({n, d}, h.options()) : at::empty({0}, h.options());
  at::Tensor grad_f = want_f ? at::empty({n, d}, h.options()) : at::empty({0}, h.options());
  at::Tensor step_rows = at::empty({n}, h.options().dtype(at::kDouble));
  AT_DISPATCH_FLOATING_TYPES(h.scalar_type(), "sphere_step_backward", [&] {
    const scalar_t* gp = g.const_data_ptr<scalar_t>();
    const scalar_t* hp = h.const_data_ptr<scalar_t>();
    const scalar_t* fp = f.const_data_ptr<scalar_t>();
    const double* sp = stats.const_data_ptr<double>();
    scalar_t* ghp = want_h ? grad_h.mutable_data_ptr<scalar_t>() : nullptr;
    scalar_t* gfp = want_f ? grad_f.mutable_data_ptr<scalar_t>() : nullptr;
    double* rp = step_rows.mutable_data_ptr<double>();
    at::parallel_for(0, n, grain_rows(d), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const int64_t o = r * d;
        const double* row_stats = sp + 3 * r;
        scalar_t* gf = want_f ? gfp + o : nullptr;
        scalar_t* gh = want_h ? ghp + o : nullptr;
        if (row_stats[0] < 0.0) {  // rescaled by the forward
          rp[r] = backward_rescaled_row(gp + o, hp + o, fp + o, d, row_stats, s, family, p, eps, gf, gh);
        } else if (row_stats[0] == 0.0) {  // a zero row, kept: the backward of a step 0
          rp[r] = backward_zero_row(gp + o, hp + o, fp + o, d, row_stats[1], gf, gh);
        } else {
          rp[r] = backward_row<scalar_t, false>(gp + o, hp + o, fp + o, d, row_stats[0], row_stats[1],
                                                row_stats[2], s, family, p, eps, gf, gh);
        }
      }
    });
  });
  return {grad_h, grad_f, step_rows};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(manifoldlib_cpu, m) {
  m.def("forward_dots(Tensor h, Tensor f) -> (Tensor, Tensor, Tensor)");
  m.def("forward_combine(Tensor h, Tensor f, Tensor[] coef, Tensor(a!) out, Tensor? parallel=None) -> ()");
  m.def("backward_dots(Tensor grad, Tensor h, Tensor f) -> Tensor");
  m.def("backward_combine(Tensor grad, Tensor h, Tensor f, Tensor[] coef_f, Tensor[] coef_h, "
        "Tensor(a!)? grad_f, Tensor(b!)? grad_h) -> ()");
  m.def("sphere_step_forward(Tensor h, Tensor f, Tensor s, int family, float p, float eps) -> (Tensor, Tensor)");
  m.def("sphere_step_backward(Tensor grad, Tensor h, Tensor f, Tensor stats, Tensor s, int family, float p, "
        "float eps, bool want_h, bool want_f) -> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(manifoldlib_cpu, CPU, m) {
  m.impl("forward_dots", &forward_dots);
  m.impl("forward_combine", &forward_combine);
  m.impl("backward_dots", &backward_dots);
  m.impl("backward_combine", &backward_combine);
  m.impl("sphere_step_forward", &sphere_step_forward);
  m.impl("sphere_step_backward", &sphere_step_backward);
}
