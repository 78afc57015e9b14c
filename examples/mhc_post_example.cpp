// mhc_post on the CPU through the installed fusekit package: wrap your own buffers in
// TensorViews (no copies), call the operator, read the result.
#include <cmath>
#include <cstdio>
#include <vector>

#include <fusekit/fusekit.h>

int main() {
  using fusekit::DType;
  using fusekit::TensorView;
  constexpr std::int64_t N = 2, hc = 4, H = 8;

  std::vector<float> x(N * H), residual(N * hc * H), post(N * hc), comb(N * hc * hc), out(N * hc * H);
  for (std::size_t k = 0; k < x.size(); ++k) x[k] = std::sin(0.1f * k);
  for (std::size_t k = 0; k < residual.size(); ++k) residual[k] = std::cos(0.05f * k);
  for (std::size_t k = 0; k < post.size(); ++k) post[k] = 0.5f + 0.1f * k;
  for (std::size_t k = 0; k < comb.size(); ++k) comb[k] = (k % (hc + 1) == 0) ? 1.0f : 0.1f;

  try {
    fusekit::mhc_post(TensorView(out.data(), DType::Float32, {N, hc, H}),
                      TensorView(x.data(), DType::Float32, {N, H}),
                      TensorView(residual.data(), DType::Float32, {N, hc, H}),
                      TensorView(post.data(), DType::Float32, {N, hc}),
                      TensorView(comb.data(), DType::Float32, {N, hc, hc}));
  } catch (const fusekit::Error& e) {
    std::fprintf(stderr, "fusekit error: %s\n", e.what());
    return 1;
  }

  // out[n, i, h] = post[n, i] * x[n, h] + sum_j comb[n, j, i] * residual[n, j, h]
  double worst = 0;
  for (std::int64_t n = 0; n < N; ++n)
    for (std::int64_t i = 0; i < hc; ++i)
      for (std::int64_t h = 0; h < H; ++h) {
        double ref = double(post[n * hc + i]) * x[n * H + h];
        for (std::int64_t j = 0; j < hc; ++j)
          ref += double(comb[(n * hc + j) * hc + i]) * residual[(n * hc + j) * H + h];
        worst = std::fmax(worst, std::fabs(ref - out[(n * hc + i) * H + h]));
      }
  std::printf("fusekit %s: mhc_post out[0, 0, :4] = %.4f %.4f %.4f %.4f, max error %.2e\n",
              fusekit::build_info().version.c_str(), out[0], out[1], out[2], out[3], worst);
  return worst < 1e-5 ? 0 : 1;
}
