// One-pass CPU kernels for the full-tensor passes of the fused sphere residual
// (manifoldlib/nn/_fused.py has the math). All tensors are contiguous (N, d) rows of one
// floating dtype (float32 or float64); a per-row coefficient is a contiguous tensor of N values.
// The per-row coefficient math stays in Python; these kernels only read and write (N, d) tensors:
//
//   forward_dots(h, f)                -> (N, 3): [||h||², <h, f>, ||f||²]      reads h, f
//   tangent_sq(h, f, c)               -> (N,): ||f - c h||²                     reads h, f
//   forward_combine(h, f, [a, b], out)   out = a h + b f                       reads h, f
//   backward_dots(g, h, f)            -> (N, 2): [<g, h>, <g, f>]              reads g, h, f
//   backward_combine(g, h, f, [c0, c1, c2], [e0, e1, e2], grad_f?, grad_h?)
//       grad_f = c0 g + c1 h + c2 f,  grad_h = e0 g + e1 h + e2 f              reads g, h, f
//
// Row dot products accumulate in double whatever the input dtype (a float32 product is exact
// in double), in kLanes independent lanes so that g++ vectorizes the loop without reassociation
// flags; the lanes are summed at the end of each block of kBlock elements. Rows are split across threads. The
// combinations write into outputs the caller allocates (see _fused.py for why).

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <optional>

#include "row_kernel.h"  // MANIFOLDLIB_ROW_KERNEL

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

// ||y - c x||² over one block, added to the row's total (the normalized step's ||P_h f||², formed
// from P_h f itself: the difference ||f||² - <h, f>²/||h||² cancels when f is nearly parallel to h).
template <typename T>
MANIFOLDLIB_ROW_KERNEL void block_residual_sq(const T* x, const T* y, double c, int64_t len, double* total) {
  double acc[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= len; i += kLanes) {
    for (int64_t j = 0; j < kLanes; ++j) {
      const double u = static_cast<double>(y[i + j]) - c * static_cast<double>(x[i + j]);
      acc[j] += u * u;
    }
  }
  double tail = 0.0;
  for (; i < len; ++i) {
    const double u = static_cast<double>(y[i]) - c * static_cast<double>(x[i]);
    tail += u * u;
  }
  total[0] += lane_sum(acc) + tail;
}

// [||x||², <x, y>, ||y||²] of one row.
template <typename T>
void row_dots3(const T* x, const T* y, int64_t d, T* out) {
  double total[3] = {};
  for (int64_t b = 0; b < d; b += kBlock) block_dots3(x + b, y + b, std::min(kBlock, d - b), total);
  for (int k = 0; k < 3; ++k) out[k] = static_cast<T>(total[k]);
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

at::Tensor forward_dots(const at::Tensor& h, const at::Tensor& f) {
  check_dtype(h);
  check_rows(h, "h", h);
  check_rows(f, "f", h);
  const int64_t n = h.size(0), d = h.size(1);
  at::Tensor out = at::empty({n, 3}, h.options());
  AT_DISPATCH_FLOATING_TYPES(h.scalar_type(), "forward_dots", [&] {
    const scalar_t* hp = h.const_data_ptr<scalar_t>();
    const scalar_t* fp = f.const_data_ptr<scalar_t>();
    scalar_t* op = out.mutable_data_ptr<scalar_t>();
    at::parallel_for(0, n, grain_rows(d), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) row_dots3(hp + r * d, fp + r * d, d, op + 3 * r);
    });
  });
  return out;
}

at::Tensor tangent_sq(const at::Tensor& h, const at::Tensor& f, const at::Tensor& coef) {
  check_dtype(h);
  check_rows(h, "h", h);
  check_rows(f, "f", h);
  check_coefs({coef}, "coef", h, 1);
  const int64_t n = h.size(0), d = h.size(1);
  at::Tensor out = at::empty({n}, h.options());
  AT_DISPATCH_FLOATING_TYPES(h.scalar_type(), "tangent_sq", [&] {
    const scalar_t* hp = h.const_data_ptr<scalar_t>();
    const scalar_t* fp = f.const_data_ptr<scalar_t>();
    const scalar_t* cp = coef.const_data_ptr<scalar_t>();
    scalar_t* op = out.mutable_data_ptr<scalar_t>();
    at::parallel_for(0, n, grain_rows(d), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        double total[1] = {};
        const double c = static_cast<double>(cp[r]);
        for (int64_t b = 0; b < d; b += kBlock) {
          block_residual_sq(hp + r * d + b, fp + r * d + b, c, std::min(kBlock, d - b), total);
        }
        op[r] = static_cast<scalar_t>(total[0]);
      }
    });
  });
  return out;
}

void forward_combine(const at::Tensor& h, const at::Tensor& f, at::TensorList coef, const at::Tensor& out) {
  check_dtype(h);
  check_rows(h, "h", h);
  check_rows(f, "f", h);
  check_coefs(coef, "coef", h, 2);
  check_rows(out, "out", h);
  const int64_t n = h.size(0), d = h.size(1);
  AT_DISPATCH_FLOATING_TYPES(h.scalar_type(), "forward_combine", [&] {
    const scalar_t* hp = h.const_data_ptr<scalar_t>();
    const scalar_t* fp = f.const_data_ptr<scalar_t>();
    const scalar_t* ap = coef[0].const_data_ptr<scalar_t>();
    const scalar_t* bp = coef[1].const_data_ptr<scalar_t>();
    scalar_t* op = out.mutable_data_ptr<scalar_t>();
    at::parallel_for(0, n, grain_rows(d), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const scalar_t a = ap[r], b = bp[r];
        const scalar_t* x = hp + r * d;
        const scalar_t* y = fp + r * d;
        scalar_t* o = op + r * d;
        for (int64_t i = 0; i < d; ++i) o[i] = a * x[i] + b * y[i];
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
  for (int64_t i = 0; i < d; ++i) {
    const T gi = g[i], xi = x[i], yi = y[i];
    o1[i] = c[0] * gi + c[1] * xi + c[2] * yi;
    o2[i] = e[0] * gi + e[1] * xi + e[2] * yi;
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

}  // namespace

TORCH_LIBRARY_FRAGMENT(manifoldlib_cpu, m) {
  m.def("forward_dots(Tensor h, Tensor f) -> Tensor");
  m.def("tangent_sq(Tensor h, Tensor f, Tensor coef) -> Tensor");
  m.def("forward_combine(Tensor h, Tensor f, Tensor[] coef, Tensor(a!) out) -> ()");
  m.def("backward_dots(Tensor grad, Tensor h, Tensor f) -> Tensor");
  m.def("backward_combine(Tensor grad, Tensor h, Tensor f, Tensor[] coef_f, Tensor[] coef_h, "
        "Tensor(a!)? grad_f, Tensor(b!)? grad_h) -> ()");
}

TORCH_LIBRARY_IMPL(manifoldlib_cpu, CPU, m) {
  m.impl("forward_dots", &forward_dots);
  m.impl("tangent_sq", &tangent_sq);
  m.impl("forward_combine", &forward_combine);
  m.impl("backward_dots", &backward_dots);
  m.impl("backward_combine", &backward_combine);
}
