// One-pass CPU kernels of the SEL chart's forward rule (manifoldlib/charts/kernel.py has the
// math). raw is a contiguous (out, in) matrix of one floating dtype (float64, float32, float16 or
// bfloat16); the rank-1 factors are contiguous vectors of out (rows) and in (columns) values of
// raw's compute dtype: raw's own for float64/float32, float32 for float16/bfloat16, whose entries
// (raw, the upstream gradient) are converted to float32 one at a time as they are read and whose
// results (W, the raw gradient) are computed in float32 and rounded once as they are written (no
// full-size float32 copy of raw, W or the gradient is made). With
// t = |w|, s = +1 where w >= 0 (-0.0 included) and -1 elsewhere, a = a_r a_c, b = b_r b_c, c = c_r c_c, e = expm1(min(b t, M)):
//
//   sel_forward(raw, a_r, a_c, b_r, b_c, c_r?, c_c?, M) -> W = s a e + c t        reads raw
//   sel_backward(grad, raw, a_r, a_c, b_r, b_c, c_r?, c_c?, M)
//       -> [g_raw, g_ar, g_ac, g_br, g_bc, g_cr, g_cc]                            reads grad, raw
//
// with k = [e < expm1(M)] (the clamp), q = G (e + 1) k and, per entry,
//   g_raw = q a b + s G c,   dL/da = s G e,   dL/db = q a w,   dL/dc = G t,
// reduced over columns for the row factors (g_ar[i] = sum_j (s G e)_ij a_c[j], ...) and over rows
// for the column factors (g_ac[j] = sum_i a_r[i] (s G e)_ij, ...). e is recomputed in the
// backward rather than stored: one read of raw instead of a read of a saved (out, in) tensor.
//
// expm1 is evaluated by a branch-free polynomial that g++ vectorizes (std::expm1 does not): for
// x = b t >= 0, x = n ln2 + r with |r| <= ln2 / 2, expm1(x) = 2^n expm1(r) + (2^n - 1), expm1(r) by
// its Taylor series (degree 13 in double, 8 in float: truncation below 1e-17 / 1e-8 relative).
// For x < ln2 / 2, n = 0 and the result is the series itself, so small x keep full relative
// accuracy. Reductions accumulate in double. Rows are split across threads; the column sums
// of each thread's rows go to a buffer of their own, added up at the end in thread order.

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/sum.h>
#include <ATen/ops/_to_copy.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

#include "row_kernel.h"  // MANIFOLDLIB_ROW_KERNEL

namespace {

constexpr int64_t kGrainElements = 1 << 15;  // elements per parallel task, at least

template <typename T>
struct Expm1Consts;

template <>
struct Expm1Consts<double> {
  using Bits = int64_t;
  static constexpr int kTerms = 13;
  static constexpr int kMantissa = 52;
  static constexpr Bits kBias = 1023;
  static constexpr double kShifter = 6755399441055744.0;  // 1.5 * 2^52: rounds to an integer
  static constexpr double kLn2Hi = 0.6931471803691238;  // 32 significant bits: n kLn2Hi exact
  static constexpr double kLn2Lo = 1.9082149292705877e-10;  // ln 2 - kLn2Hi
};

template <>
struct Expm1Consts<float> {
  using Bits = int32_t;
  static constexpr int kTerms = 8;
  static constexpr int kMantissa = 23;
  static constexpr Bits kBias = 127;
  static constexpr float kShifter = 12582912.0f;  // 1.5 * 2^23
  // 9 significant bits, so that n kLn2Hi is exact in float for |n| <= 2^14 (the double split's
  // 0.6931471803691238 rounds to a float 1.9e-9 above ln 2, an error of n 1.9e-9 in r: 4.9 ulps
  // of expm1 near x = 88; now within 1.7 ulps everywhere, the polynomial's own rounding)
  static constexpr float kLn2Hi = 0.693359375f;
  static constexpr float kLn2Lo = -2.12194440e-4f;  // ln 2 - kLn2Hi
};

// 1 + r/K (1 + r/(K+1) (... (1 + r/N))): the Taylor series of expm1(r) / r from K = 2, unrolled
// at compile time (a loop here keeps g++ from vectorizing the loops over a row around it)
template <typename T, int K, int N>
struct Horner {
  static inline T eval(T r) { return T(1) + r * T(1.0 / K) * Horner<T, K + 1, N>::eval(r); }
};

template <typename T, int N>
struct Horner<T, N, N> {
  static inline T eval(T r) { return T(1) + r * T(1.0 / N); }
};

// expm1(x) for 0 <= x <= M (M = 0.5 ln(max) keeps 2^n representable). Branch free.
template <typename T>
inline T expm1_nonnegative(T x) {
  using C = Expm1Consts<T>;
  using Bits = typename C::Bits;
  const T log2e = static_cast<T>(1.4426950408889634);
  const T ln2_hi = C::kLn2Hi;  // ln 2 split per type: ln2_hi * n exact
  const T ln2_lo = C::kLn2Lo;
  const T shifted = x * log2e + C::kShifter;  // its low mantissa bits hold round(x / ln 2)
  const T n = shifted - C::kShifter;  // nearest integer to x / ln 2
  const T r = (x - n * ln2_hi) - n * ln2_lo;  // |r| <= ln2 / 2
  // Taylor series of expm1(r), Horner form: r (1 + r/2 (1 + r/3 (1 + ...)))
  const T em1 = r * Horner<T, 2, C::kTerms>::eval(r);
  // 2^n from the integer in shifted's bits (integer lane arithmetic only: AVX2 has no
  // double -> int64 conversion, so a cast would keep the loop scalar)
  const T shifter = C::kShifter;
  Bits bits, base;
  std::memcpy(&bits, &shifted, sizeof(T));
  std::memcpy(&base, &shifter, sizeof(T));
  bits = (bits - base + C::kBias) << C::kMantissa;
  T scale;
  std::memcpy(&scale, &bits, sizeof(T));  // 2^n
  return scale * em1 + (scale - static_cast<T>(1));
}

// s = +1 for w >= 0 (also at -0.0), -1 below: the chart's sign convention
template <typename T>
inline T sign_of(T w) {
  return static_cast<T>(2) * static_cast<T>(w >= static_cast<T>(0)) - static_cast<T>(1);
}

constexpr int64_t kLanes = 8;  // double accumulators of a row sum (g++ vectorizes across them)

// sum_j x[j] y[j] in double, in kLanes independent lanes
template <typename T>
double row_dot(const T* x, const T* y, int64_t len) {
  double acc[kLanes] = {};
  int64_t j = 0;
  for (; j + kLanes <= len; j += kLanes) {
    for (int64_t l = 0; l < kLanes; ++l) acc[l] += static_cast<double>(x[j + l]) * static_cast<double>(y[j + l]);
  }
  double s = 0.0;
  for (int64_t l = 0; l < kLanes; ++l) s += acc[l];
  for (; j < len; ++j) s += static_cast<double>(x[j]) * static_cast<double>(y[j]);
  return s;
}

// One row of the forward: out[j] = s a e + c t. A function of its own (not inlined into the loop
// over rows) so that g++ vectorizes along the row; `Linear` a template flag, not a branch. T is
// raw's (and W's) storage type, A the type of the arithmetic and of the factors (T itself, or
// float for at::Half / at::BFloat16: each entry converted on reading, rounded once on writing).
template <typename T, typename A, bool Linear>
MANIFOLDLIB_ROW_KERNEL void forward_row(const T* __restrict w, const A* __restrict ac, const A* __restrict bc,
                                        const A* __restrict cc, A ar, A br, A cr, A m, int64_t cols,
                                        T* __restrict out) {
  for (int64_t j = 0; j < cols; ++j) {
    const A wj = static_cast<A>(w[j]);
    const A t = std::abs(wj);
    const A e = expm1_nonnegative(std::min(br * bc[j] * t, m));
    A v = sign_of(wj) * (ar * ac[j] * e);
    if (Linear) v += cr * cc[j] * t;
    out[j] = static_cast<T>(v);
  }
}

// One row of the backward's elementwise part: g_raw, and the per-entry factor gradients the
// reductions read (ge = s G e, qaw = q a w = dL/db, gt = G t; in A, unrounded). q is multiplied by
// a = a_r a_c before w: q w alone reaches e^M M / b (inf in float32 from M = 84 at b = 1), where
// dL/db = q a w is finite whenever a e^M M / b is.
template <typename T, typename A, bool Linear>
MANIFOLDLIB_ROW_KERNEL void backward_row(const T* __restrict g, const T* __restrict w, const A* __restrict ac,
                                         const A* __restrict bc, const A* __restrict cc, A ar, A abr, A br, A cr,
                                         A m, A limit, int64_t cols, T* __restrict g_raw, A* __restrict ge,
                                         A* __restrict qaw, A* __restrict gt) {
  for (int64_t j = 0; j < cols; ++j) {
    const A wj = static_cast<A>(w[j]), gj = static_cast<A>(g[j]);
    const A t = std::abs(wj);
    const A e = expm1_nonnegative(std::min(br * bc[j] * t, m));
    const A q = gj * (e + A(1)) * static_cast<A>(e < limit);  // branch free: k = [e < limit]
    const A sg = sign_of(wj) * gj;  // s G
    ge[j] = sg * e;
    qaw[j] = q * (ar * ac[j]) * wj;
    A v = q * (abr * ac[j] * bc[j]);
    if (Linear) {
      v += sg * (cr * cc[j]);
      gt[j] = gj * t;
    }
    g_raw[j] = static_cast<T>(v);
  }
}

int64_t grain_rows(int64_t cols) { return std::max<int64_t>(1, kGrainElements / std::max<int64_t>(cols, 1)); }

void check(const at::Tensor& raw, const at::Tensor& a_r, const at::Tensor& a_c, const at::Tensor& b_r,
           const at::Tensor& b_c, const std::optional<at::Tensor>& c_r, const std::optional<at::Tensor>& c_c) {
  TORCH_CHECK(raw.dim() == 2 && raw.is_contiguous(), "sel kernels need a contiguous (out, in) matrix");
  const int64_t rows = raw.size(0), cols = raw.size(1);
  const auto work = at::toOpMathType(raw.scalar_type());  // the factors' dtype: float32 for 16-bit raw
  for (const at::Tensor* t : {&a_r, &b_r}) {
    TORCH_CHECK(t->numel() == rows && t->is_contiguous() && t->scalar_type() == work,
                "sel kernels: a row factor must be a contiguous vector of out values in raw's compute dtype");
  }
  for (const at::Tensor* t : {&a_c, &b_c}) {
    TORCH_CHECK(t->numel() == cols && t->is_contiguous() && t->scalar_type() == work,
                "sel kernels: a column factor must be a contiguous vector of in values in raw's compute dtype");
  }
  TORCH_CHECK(c_r.has_value() == c_c.has_value(), "sel kernels: give both linear factors or neither");
  if (c_r.has_value()) {
    TORCH_CHECK(c_r->numel() == rows && c_r->is_contiguous() && c_r->scalar_type() == work &&
                    c_c->numel() == cols && c_c->is_contiguous() && c_c->scalar_type() == work,
                "sel kernels: the linear factors must be contiguous vectors in raw's compute dtype");
  }
}

at::Tensor sel_forward(const at::Tensor& raw, const at::Tensor& a_r, const at::Tensor& a_c, const at::Tensor& b_r,
                       const at::Tensor& b_c, const std::optional<at::Tensor>& c_r,
                       const std::optional<at::Tensor>& c_c, double max_exponent) {
  check(raw, a_r, a_c, b_r, b_c, c_r, c_c);
  at::Tensor out = at::empty_like(raw);
  const int64_t rows = raw.size(0), cols = raw.size(1);
  const bool linear = c_r.has_value();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::ScalarType::Half, at::ScalarType::BFloat16, raw.scalar_type(), "sel_forward", [&] {
    using acc_t = at::opmath_type<scalar_t>;  // scalar_t for float/double, float for the 16-bit types
    const scalar_t* w = raw.data_ptr<scalar_t>();
    const acc_t *ar = a_r.data_ptr<acc_t>(), *ac = a_c.data_ptr<acc_t>();
    const acc_t *br = b_r.data_ptr<acc_t>(), *bc = b_c.data_ptr<acc_t>();
    const acc_t* cr = linear ? c_r->data_ptr<acc_t>() : nullptr;
    const acc_t* cc = linear ? c_c->data_ptr<acc_t>() : nullptr;
    scalar_t* o = out.data_ptr<scalar_t>();
    const acc_t m = static_cast<acc_t>(max_exponent);
    at::parallel_for(0, rows, grain_rows(cols), [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const scalar_t* wi = w + i * cols;
        scalar_t* oi = o + i * cols;
        const acc_t ari = ar[i], bri = br[i], cri = linear ? cr[i] : acc_t(0);
        if (linear) {
          forward_row<scalar_t, acc_t, true>(wi, ac, bc, cc, ari, bri, cri, m, cols, oi);
        } else {
          forward_row<scalar_t, acc_t, false>(wi, ac, bc, cc, ari, bri, cri, m, cols, oi);
        }
      }
    });
  });
  return out;
}

std::vector<at::Tensor> sel_backward(const at::Tensor& grad_in, const at::Tensor& raw, const at::Tensor& a_r,
                                     const at::Tensor& a_c, const at::Tensor& b_r, const at::Tensor& b_c,
                                     const std::optional<at::Tensor>& c_r, const std::optional<at::Tensor>& c_c,
                                     double max_exponent) {
  check(raw, a_r, a_c, b_r, b_c, c_r, c_c);
  const at::Tensor grad = grad_in.contiguous();
  TORCH_CHECK(grad.sizes() == raw.sizes() && grad.scalar_type() == raw.scalar_type(),
              "sel_backward: the gradient must match raw's shape and dtype");
  const int64_t rows = raw.size(0), cols = raw.size(1);
  const bool linear = c_r.has_value();
  at::Tensor g_raw = at::empty_like(raw);
  // row sums (out each) and column sums (in each) of the factor gradients, in double
  at::Tensor row_sums = at::zeros({3, rows}, raw.options().dtype(at::kDouble));
  // one column buffer per task: tasks are the row blocks below, run in any order
  const int64_t tasks = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), rows));
  const int64_t per_task = (rows + tasks - 1) / tasks;
  at::Tensor col_parts = at::zeros({tasks, 3, cols}, raw.options().dtype(at::kDouble));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::ScalarType::Half, at::ScalarType::BFloat16, raw.scalar_type(), "sel_backward", [&] {
    using acc_t = at::opmath_type<scalar_t>;  // scalar_t for float/double, float for the 16-bit types
    const scalar_t *g = grad.data_ptr<scalar_t>(), *w = raw.data_ptr<scalar_t>();
    const acc_t *ar = a_r.data_ptr<acc_t>(), *ac = a_c.data_ptr<acc_t>();
    const acc_t *br = b_r.data_ptr<acc_t>(), *bc = b_c.data_ptr<acc_t>();
    const acc_t* cr = linear ? c_r->data_ptr<acc_t>() : nullptr;
    const acc_t* cc = linear ? c_c->data_ptr<acc_t>() : nullptr;
    scalar_t* gr = g_raw.data_ptr<scalar_t>();
    double* rs = row_sums.data_ptr<double>();
    double* cp = col_parts.data_ptr<double>();
    const acc_t m = static_cast<acc_t>(max_exponent);
    const acc_t limit = expm1_nonnegative(m);  // e at the clamp: its entries get no gradient
    at::parallel_for(0, tasks, 1, [&](int64_t first, int64_t last) {
      std::vector<acc_t> ge(cols), qaw(cols), gt(cols);  // one row's dL/da, dL/db, dL/dc
      for (int64_t task = first; task < last; ++task) {
        double* col_a = cp + task * 3 * cols;  // sum_i a_r[i] (s G e)_ij
        double* col_b = col_a + cols;          // sum_i b_r[i] (q a w)_ij
        double* col_c = col_b + cols;          // sum_i c_r[i] G_ij t_ij
        const int64_t row_end = std::min(rows, (task + 1) * per_task);
        for (int64_t i = task * per_task; i < row_end; ++i) {
          const scalar_t *gi = g + i * cols, *wi = w + i * cols;
          scalar_t* gri = gr + i * cols;
          const acc_t ari = ar[i], bri = br[i], cri = linear ? cr[i] : acc_t(0);
          const acc_t abr = ari * bri;
          if (linear) {  // the elementwise part
            backward_row<scalar_t, acc_t, true>(gi, wi, ac, bc, cc, ari, abr, bri, cri, m, limit, cols, gri,
                                                ge.data(), qaw.data(), gt.data());
          } else {
            backward_row<scalar_t, acc_t, false>(gi, wi, ac, bc, cc, ari, abr, bri, cri, m, limit, cols, gri,
                                                 ge.data(), qaw.data(), gt.data());
          }
          for (int64_t j = 0; j < cols; ++j) {  // column sums (independent per j: vectorized)
            col_a[j] += static_cast<double>(ari) * static_cast<double>(ge[j]);
            col_b[j] += static_cast<double>(bri) * static_cast<double>(qaw[j]);
          }
          rs[i] = row_dot(ge.data(), ac, cols);
          rs[rows + i] = row_dot(qaw.data(), bc, cols);
          if (linear) {
            for (int64_t j = 0; j < cols; ++j) col_c[j] += static_cast<double>(cri) * static_cast<double>(gt[j]);
            rs[2 * rows + i] = row_dot(gt.data(), cc, cols);
          }
        }
      }
    });
  });
  at::Tensor cols_sum = col_parts.sum(0);  // (3, in), in task order
  const auto dtype = a_r.scalar_type();  // the factors' (raw's compute dtype): g_raw alone is in raw's
  at::Tensor g_ar = row_sums[0].to(dtype).view(a_r.sizes());
  at::Tensor g_br = row_sums[1].to(dtype).view(b_r.sizes());
  at::Tensor g_ac = cols_sum[0].to(dtype).view(a_c.sizes());
  at::Tensor g_bc = cols_sum[1].to(dtype).view(b_c.sizes());
  std::vector<at::Tensor> out = {g_raw, g_ar, g_ac, g_br, g_bc};
  if (linear) {
    out.push_back(row_sums[2].to(dtype).view(c_r->sizes()));
    out.push_back(cols_sum[2].to(dtype).view(c_c->sizes()));
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(manifoldlib_cpu, m) {
  m.def("sel_forward(Tensor raw, Tensor a_r, Tensor a_c, Tensor b_r, Tensor b_c, Tensor? c_r, Tensor? c_c, "
        "float max_exponent) -> Tensor");
  m.def("sel_backward(Tensor grad, Tensor raw, Tensor a_r, Tensor a_c, Tensor b_r, Tensor b_c, Tensor? c_r, "
        "Tensor? c_c, float max_exponent) -> Tensor[]");
}

TORCH_LIBRARY_IMPL(manifoldlib_cpu, CPU, m) {
  m.impl("sel_forward", &sel_forward);
  m.impl("sel_backward", &sel_backward);
}
