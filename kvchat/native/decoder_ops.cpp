// The small ops of a decoder layer, fused: residual add + RMSNorm, rotary, SiLU(gate) * up.
//
// Why: a decode step works on a handful of rows of 576 to 1,536 numbers, where a torch
// op's dispatch from Python (a few microseconds) costs more than its arithmetic, and
// the unfused layer runs about forty of them (an RMSNorm alone is nine). Fused, a
// layer's small ops are four calls. Each op rounds to the activation dtype exactly
// where torch's unfused sequence does (after every op), so results match torch's to
// the last bit in nearly every element and transformers' within the usual tolerance
// (tests/test_decoder_ops.py checks both).
//
// Rows are independent: long inputs (prefill) are split over torch's thread pool by
// rows, short ones (decode) run on the calling thread. The loops are plain scalar
// code written so that -O3 -march=native -ffast-math vectorizes them (bf16 rounding
// is integer arithmetic; exp comes from the vector math library).
// Compiled with paged_attention.cpp by kvchat/native/build.py.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include "element_types.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#include <sleef.h>  // torch's own vector exp (libtorch_cpu exports it): SiLU as torch rounds it
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <tuple>

namespace {

using kvchat::narrow;
using kvchat::rounded;
using kvchat::widen;

constexpr int64_t kSerialElements = 32768;  // below this many elements a call stays on one thread
constexpr int64_t kMaxHeadDim = 256;
constexpr int64_t kMaxGemmaWidth = 1 << 14;  // a row's normalized addend on the stack

template <typename F>
void for_rows(int64_t rows, int64_t width, const F& body) {
  const int64_t grain = std::max<int64_t>(1, kSerialElements / std::max<int64_t>(width, 1));
  if (rows <= grain) {
    body(0, rows);
  } else {
    at::parallel_for(0, rows, grain, body);
  }
}

// 1 / sqrt(mean(x^2) + eps) of a row, in float32.
template <typename T>
float inverse_rms(const T* x, int64_t width, float eps) {
  float squares = 0.f;
  for (int64_t i = 0; i < width; ++i) {
    const float v = widen(x[i]);
    squares += v * v;
  }
  return 1.f / std::sqrt(squares / static_cast<float>(width) + eps);
}

// transformers' LlamaRMSNorm: float32 statistics, x * inv rounded to the dtype, then
// times the weight in the dtype.
template <typename T>
void norm_row(const T* x, const T* weight, T* out, int64_t width, float eps) {
  const float inv = inverse_rms(x, width, eps);
  for (int64_t i = 0; i < width; ++i) {
    out[i] = narrow<T>(widen(weight[i]) * rounded<T>(widen(x[i]) * inv));
  }
}

template <typename T>
void rms_norm_kernel(const at::Tensor& x, const at::Tensor& weight, double eps, at::Tensor& out) {
  const int64_t width = x.size(1);
  const T* xp = x.data_ptr<T>();
  const T* wp = weight.data_ptr<T>();
  T* op = out.data_ptr<T>();
  for_rows(x.size(0), width, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      norm_row(xp + r * width, wp, op + r * width, width, static_cast<float>(eps));
    }
  });
}

template <typename T>
void add_rms_norm_kernel(const at::Tensor& h, const at::Tensor& delta, const at::Tensor& weight,
                         double eps, at::Tensor& sum, at::Tensor& out) {
  const int64_t width = h.size(1);
  const T* hp = h.data_ptr<T>();
  const T* dp = delta.data_ptr<T>();
  const T* wp = weight.data_ptr<T>();
  T* sp = sum.data_ptr<T>();
  T* op = out.data_ptr<T>();
  for_rows(h.size(0), width, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t base = r * width;
      for (int64_t i = 0; i < width; ++i) {
        sp[base + i] = narrow<T>(widen(hp[base + i]) + widen(dp[base + i]));
      }
      norm_row(sp + base, wp, op + base, width, static_cast<float>(eps));
    }
  });
}

// rotate_half rotary in place on the first `heads` heads of each row: x * cos rounded,
// then + roll(x, D/2) * signed_sin in one rounding (torch's mul, then addcmul).
template <typename T>
void rotary_kernel(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, int64_t heads) {
  const int64_t dim = cos.size(1);
  const int64_t half = dim / 2;
  const int64_t stride = x.stride(0);
  T* xp = x.data_ptr<T>();
  const T* cp = cos.data_ptr<T>();
  const T* sp = sin.data_ptr<T>();
  for_rows(x.size(0), heads * dim, [&](int64_t begin, int64_t end) {
    float buf[kMaxHeadDim];
    for (int64_t r = begin; r < end; ++r) {
      const T* c = cp + r * dim;
      const T* s = sp + r * dim;
      for (int64_t head = 0; head < heads; ++head) {
        T* p = xp + r * stride + head * dim;
        for (int64_t j = 0; j < dim; ++j) buf[j] = widen(p[j]);
        for (int64_t j = 0; j < half; ++j) {
          p[j] = narrow<T>(rounded<T>(buf[j] * widen(c[j])) + buf[j + half] * widen(s[j]));
        }
        for (int64_t j = half; j < dim; ++j) {
          p[j] = narrow<T>(rounded<T>(buf[j] * widen(c[j])) + buf[j - half] * widen(s[j]));
        }
      }
    }
  });
}

// silu(gate) rounded, times up rounded: torch's F.silu then *. With AVX-512 the exp is
// torch's own (Sleef, 1 ulp), so the result is torch's bit for bit; elsewhere std::exp.
// exp's argument is capped at 88 so no infinity is made: -ffast-math may divide by way
// of a refined reciprocal, which turns 1 / inf into NaN (silu(-100) is then -6e-37, not -0).
inline float silu(float g) { return g / (1.f + std::exp(std::min(-g, 88.f))); }


template <typename T>
void silu_mul_row(const T* gate, const T* up, T* out, int64_t width) {
  int64_t j = 0;
#if defined(__AVX512F__)
  const __m512 one = _mm512_set1_ps(1.f), cap = _mm512_set1_ps(88.f);
  for (; j + 16 <= width; j += 16) {
    const __m512 g = kvchat::widen16(gate + j);
    const __m512 e = Sleef_expf16_u10(_mm512_min_ps(_mm512_sub_ps(_mm512_setzero_ps(), g), cap));
    const __m512 s = kvchat::rounded16<T>(_mm512_div_ps(g, _mm512_add_ps(one, e)));
    kvchat::store16(out + j, _mm512_mul_ps(s, kvchat::widen16(up + j)));
  }
#endif
  for (; j < width; ++j) out[j] = narrow<T>(rounded<T>(silu(widen(gate[j]))) * widen(up[j]));
}

// act(gate) * up for every row of gate_up [rows, 2 * width] (gate then up), by `row`.
template <typename T, typename Row>
void gated_kernel(const at::Tensor& gate_up, at::Tensor& out, Row row) {
  const int64_t width = out.size(1);
  const T* gp = gate_up.data_ptr<T>();
  T* op = out.data_ptr<T>();
  for_rows(out.size(0), width, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* gate = gp + r * 2 * width;
      row(gate, gate + width, op + r * width, width);
    }
  });
}

// Gemma's RMSNorm (transformers' Gemma3RMSNorm): float32 statistics, x * inv times the
// float32 factor (1 + w), rounded to the dtype once at the end (Llama's rounds x * inv
// first and multiplies in the dtype).
template <typename T>
void gemma_norm_row(const T* x, const float* factor, T* out, int64_t width, float eps) {
  const float inv = inverse_rms(x, width, eps);
  for (int64_t i = 0; i < width; ++i) out[i] = narrow<T>((widen(x[i]) * inv) * factor[i]);
}

// h + gemma_norm(y, post) rounded (the residual after attention, its output normalized),
// then gemma_norm of that sum with `pre` (the feed-forward's input). `y` may be null:
// plain h + delta (`delta`), as at a layer's start.
template <typename T>
void gemma_add_norm_kernel(const at::Tensor& h, const at::Tensor& y, const float* post,
                           const float* pre, double eps, at::Tensor& sum, at::Tensor& out) {
  const int64_t width = h.size(1);
  const T* hp = h.data_ptr<T>();
  const T* yp = y.data_ptr<T>();
  T* sp = sum.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const float e = static_cast<float>(eps);
  for_rows(h.size(0), width, [&](int64_t begin, int64_t end) {
    T normed[kMaxGemmaWidth];
    for (int64_t r = begin; r < end; ++r) {
      const int64_t base = r * width;
      const T* add = yp + base;
      if (post != nullptr) {
        gemma_norm_row(yp + base, post, normed, width, e);
        add = normed;
      }
      for (int64_t i = 0; i < width; ++i) {
        sp[base + i] = narrow<T>(widen(hp[base + i]) + widen(add[i]));
      }
      gemma_norm_row(sp + base, pre, op + base, width, e);
    }
  });
}

// gelu(gate) (tanh form) rounded, times up rounded: torch's F.gelu(approximate="tanh")
// then *, with torch's own constants and order; tanh is torch's own (Sleef) with AVX-512.
inline float gelu_tanh(float x) {
  constexpr float kBeta = static_cast<float>(M_SQRT2 * M_2_SQRTPI * 0.5);
  constexpr float kKappa = 0.044715f;
  const float cube = x * x * x;
  return 0.5f * x * (1.f + std::tanh(kBeta * (x + kKappa * cube)));
}

template <typename T>
void gelu_mul_row(const T* gate, const T* up, T* out, int64_t width) {
  int64_t j = 0;
#if defined(__AVX512F__)
  const __m512 beta = _mm512_set1_ps(static_cast<float>(M_SQRT2 * M_2_SQRTPI * 0.5));
  const __m512 kappa = _mm512_set1_ps(0.044715f), one = _mm512_set1_ps(1.f),
               half = _mm512_set1_ps(0.5f);
  for (; j + 16 <= width; j += 16) {
    const __m512 x = kvchat::widen16(gate + j);
    const __m512 cube = _mm512_mul_ps(_mm512_mul_ps(x, x), x);
    const __m512 inner = _mm512_mul_ps(beta, _mm512_add_ps(x, _mm512_mul_ps(kappa, cube)));
    const __m512 g = _mm512_mul_ps(_mm512_mul_ps(half, x),
                                   _mm512_add_ps(one, Sleef_tanhf16_u10(inner)));
    kvchat::store16(out + j, _mm512_mul_ps(kvchat::rounded16<T>(g), kvchat::widen16(up + j)));
  }
#endif
  for (; j < width; ++j) out[j] = narrow<T>(rounded<T>(gelu_tanh(widen(gate[j]))) * widen(up[j]));
}

template <typename F>
void dispatch_dtype(const at::Tensor& x, const char* op, const F& body) {
  if (x.scalar_type() == at::kBFloat16) {
    body(c10::BFloat16{});
  } else if (x.scalar_type() == at::kFloat) {
    body(float{});
  } else {
    TORCH_CHECK(false, "kvchat ", op, ": dtype ", x.scalar_type(), " is not compiled");
  }
}

void check_rows(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), name, ": a contiguous [rows, width] tensor");
}

void check_weight(const at::Tensor& weight, const at::Tensor& x) {
  TORCH_CHECK(weight.dim() == 1 && weight.is_contiguous() && weight.size(0) == x.size(1) &&
                  weight.scalar_type() == x.scalar_type(),
              "norm weight: contiguous [width], in the input's dtype");
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, "rms_norm input");
  check_weight(weight, x);
  at::Tensor out = at::empty_like(x);
  dispatch_dtype(x, "rms_norm", [&](auto t) {
    rms_norm_kernel<decltype(t)>(x, weight, eps, out);
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& h, const at::Tensor& delta,
                                                const at::Tensor& weight, double eps) {
  check_rows(h, "add_rms_norm input");
  check_rows(delta, "add_rms_norm delta");
  TORCH_CHECK(delta.sizes() == h.sizes() && delta.scalar_type() == h.scalar_type(),
              "add_rms_norm: delta shaped and typed like the input");
  check_weight(weight, h);
  at::Tensor sum = at::empty_like(h);
  at::Tensor out = at::empty_like(h);
  dispatch_dtype(h, "add_rms_norm", [&](auto t) {
    add_rms_norm_kernel<decltype(t)>(h, delta, weight, eps, sum, out);
  });
  return {sum, out};
}

void rotary_(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin, int64_t heads) {
  check_rows(cos, "rotary cos");
  check_rows(sin, "rotary sin");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "rotary input: [rows, width], rows dense");
  const int64_t dim = cos.size(1);
  TORCH_CHECK(dim % 2 == 0 && dim <= kMaxHeadDim, "rotary: even head size up to ", kMaxHeadDim);
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.size(0) == x.size(0) &&
                  heads * dim <= x.size(1),
              "rotary: cos/sin [rows, head_dim], heads within the row");
  TORCH_CHECK(cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type(),
              "rotary: cos/sin in the input's dtype");
  dispatch_dtype(x, "rotary", [&](auto t) { rotary_kernel<decltype(t)>(x, cos, sin, heads); });
}

// act(gate) * up of gate_up [rows, 2 * width]: `row_of(T{})` is the row function for T.
template <typename RowOf>
at::Tensor gated(const at::Tensor& gate_up, const char* op, RowOf row_of) {
  check_rows(gate_up, (std::string(op) + " input").c_str());
  TORCH_CHECK(gate_up.size(1) % 2 == 0, op, ": [rows, 2 * width]");
  at::Tensor out = at::empty({gate_up.size(0), gate_up.size(1) / 2}, gate_up.options());
  dispatch_dtype(gate_up, op, [&](auto t) {
    gated_kernel<decltype(t)>(gate_up, out, row_of(t));
  });
  return out;
}

at::Tensor silu_mul(const at::Tensor& gate_up) {
  return gated(gate_up, "silu_mul", [](auto t) { return silu_mul_row<decltype(t)>; });
}

void check_factor(const at::Tensor& factor, int64_t width, const char* op) {
  TORCH_CHECK(factor.dim() == 1 && factor.is_contiguous() && factor.size(0) == width &&
                  factor.scalar_type() == at::kFloat,
              op, ": the (1 + w) factor float32, contiguous [", width, "]");
}

at::Tensor gemma_rms_norm(const at::Tensor& x, const at::Tensor& factor, double eps) {
  check_rows(x, "gemma_rms_norm input");
  check_factor(factor, x.size(1), "gemma_rms_norm");
  at::Tensor out = at::empty_like(x);
  const float* f = factor.data_ptr<float>();
  dispatch_dtype(x, "gemma_rms_norm", [&](auto t) {
    using T = decltype(t);
    const int64_t width = x.size(1);
    const T* xp = x.data_ptr<T>();
    T* op = out.data_ptr<T>();
    for_rows(x.size(0), width, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        gemma_norm_row(xp + r * width, f, op + r * width, width, static_cast<float>(eps));
      }
    });
  });
  return out;
}

// Heads [0, q_heads) of each row normalized with q_factor and the next k_heads with
// k_factor, in place: Gemma's q_norm and k_norm on the fused projection's rows.
void gemma_heads_norm_(at::Tensor x, const at::Tensor& q_factor, const at::Tensor& k_factor,
                       int64_t q_heads, int64_t k_heads, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "gemma_heads_norm_ input: [rows, width]");
  const int64_t dim = q_factor.size(0);
  check_factor(q_factor, dim, "gemma_heads_norm_");
  check_factor(k_factor, dim, "gemma_heads_norm_");
  TORCH_CHECK(dim <= kMaxHeadDim, "gemma_heads_norm_: head size up to ", kMaxHeadDim);
  TORCH_CHECK((q_heads + k_heads) * dim <= x.size(1), "gemma_heads_norm_: heads within the row");
  const float* qf = q_factor.data_ptr<float>();
  const float* kf = k_factor.data_ptr<float>();
  dispatch_dtype(x, "gemma_heads_norm_", [&](auto t) {
    using T = decltype(t);
    T* xp = x.data_ptr<T>();
    const int64_t stride = x.stride(0);
    for_rows(x.size(0), (q_heads + k_heads) * dim, [&](int64_t begin, int64_t end) {
      T normed[kMaxHeadDim];
      for (int64_t r = begin; r < end; ++r) {
        for (int64_t h = 0; h < q_heads + k_heads; ++h) {
          T* head = xp + r * stride + h * dim;
          gemma_norm_row(head, h < q_heads ? qf : kf, normed, dim, static_cast<float>(eps));
          std::memcpy(head, normed, dim * sizeof(T));
        }
      }
    });
  });
}

std::tuple<at::Tensor, at::Tensor> gemma_add_rms_norm(const at::Tensor& h, const at::Tensor& y,
                                                      const std::optional<at::Tensor>& post,
                                                      const at::Tensor& pre, double eps) {
  check_rows(h, "gemma_add_rms_norm input");
  check_rows(y, "gemma_add_rms_norm addend");
  TORCH_CHECK(y.sizes() == h.sizes() && y.scalar_type() == h.scalar_type(),
              "gemma_add_rms_norm: the addend shaped and typed like the input");
  TORCH_CHECK(h.size(1) <= kMaxGemmaWidth, "gemma_add_rms_norm: width up to ", kMaxGemmaWidth);
  check_factor(pre, h.size(1), "gemma_add_rms_norm");
  if (post.has_value()) check_factor(*post, h.size(1), "gemma_add_rms_norm");
  at::Tensor sum = at::empty_like(h);
  at::Tensor out = at::empty_like(h);
  const float* post_p = post.has_value() ? post->data_ptr<float>() : nullptr;
  dispatch_dtype(h, "gemma_add_rms_norm", [&](auto t) {
    gemma_add_norm_kernel<decltype(t)>(h, y, post_p, pre.data_ptr<float>(), eps, sum, out);
  });
  return {sum, out};
}

at::Tensor gelu_tanh_mul(const at::Tensor& gate_up) {
  return gated(gate_up, "gelu_tanh_mul", [](auto t) { return gelu_mul_row<decltype(t)>; });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvchat, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor h, Tensor delta, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("rotary_(Tensor(a!) x, Tensor cos, Tensor sin, int heads) -> ()");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def("gemma_rms_norm(Tensor x, Tensor factor, float eps) -> Tensor");
  m.def(
      "gemma_heads_norm_(Tensor(a!) x, Tensor q_factor, Tensor k_factor, int q_heads, "
      "int k_heads, float eps) -> ()");
  m.def(
      "gemma_add_rms_norm(Tensor h, Tensor y, Tensor? post, Tensor pre, float eps) "
      "-> (Tensor, Tensor)");
  m.def("gelu_tanh_mul(Tensor gate_up) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvchat, CPU, m) {
  m.impl("rms_norm", rms_norm);
  m.impl("add_rms_norm", add_rms_norm);
  m.impl("rotary_", rotary_);
  m.impl("silu_mul", silu_mul);
  m.impl("gemma_rms_norm", gemma_rms_norm);
  m.impl("gemma_heads_norm_", gemma_heads_norm_);
  m.impl("gemma_add_rms_norm", gemma_add_rms_norm);
  m.impl("gelu_tanh_mul", gelu_tanh_mul);
}
