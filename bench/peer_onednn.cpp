// Peer "onednn_sum": oneDNN's sum primitive, dst = sum_t (1/T) * src_t, over T 1-D f32 (or bf16)
// memories that wrap the towers in place. oneDNN has no fused sum of squares, so the squares
// (f32 only) take two steps: eltwise_pow (alpha = 1/T, beta = 2) of each tower into its own
// scratch buffer, then a plain sum of the scratch buffers. Only compiled when oneDNN is found.
#include <stdexcept>
#include <string>
#include <type_traits>
#include <unordered_map>
#include <vector>

#include <oneapi/dnnl/dnnl.hpp>

#if defined(GRADAVG_BENCH_HAVE_OMP) && DNNL_CPU_RUNTIME == DNNL_RUNTIME_OMP
#include <omp.h>
#define GRADAVG_BENCH_SET_OMP_THREADS 1
#endif

#include "peers.hpp"

namespace gradavg_bench {
namespace {

using dnnl::memory;

template <class S>
constexpr memory::data_type data_type_of() {
  static_assert(std::is_same_v<S, float> || std::is_same_v<S, Eigen::bfloat16>);
  return std::is_same_v<S, float> ? memory::data_type::f32 : memory::data_type::bf16;
}

template <class S>
class onednn_sum final : public runner {
 public:
  explicit onednn_sum(const problem<S>& p) : eng_(dnnl::engine::kind::cpu, 0), strm_(eng_) {
#ifdef GRADAVG_BENCH_SET_OMP_THREADS
    // oneDNN's OpenMP runtime takes its thread count from the calling thread.
    omp_set_num_threads(p.threads);
#else
    if (p.threads != 1) throw std::runtime_error("onednn_sum: cannot set the thread count");
#endif
    const auto towers = static_cast<int>(p.towers.size());
    const memory::desc md({static_cast<memory::dim>(p.elements)}, data_type_of<S>(), memory::format_tag::a);
    const std::vector<memory::desc> srcs(p.towers.size(), md);

    const dnnl::sum::primitive_desc mean_pd(md, std::vector<float>(p.towers.size(), 1.0f / towers),
                                            srcs, eng_);
    mean_ = dnnl::sum(mean_pd);
    mean_args_[DNNL_ARG_DST] = memory(md, eng_, p.mean);
    for (int t = 0; t < towers; ++t)
      // oneDNN takes non-const handles; sources are only read.
      mean_args_[DNNL_ARG_MULTIPLE_SRC + t] =
          memory(md, eng_, const_cast<S*>(p.towers[static_cast<std::size_t>(t)]));
    if (p.sq == nullptr) return;
    if (!std::is_same_v<S, float>) throw std::runtime_error("onednn_sum: squares on f32 only");

    const dnnl::eltwise_forward::desc pow_d(dnnl::prop_kind::forward_inference,
                                            dnnl::algorithm::eltwise_pow, md, 1.0f / towers, 2.0f);
    pow_ = dnnl::eltwise_forward(dnnl::eltwise_forward::primitive_desc(pow_d, eng_));
    const dnnl::sum::primitive_desc sq_pd(md, std::vector<float>(p.towers.size(), 1.0f), srcs, eng_);
    sq_ = dnnl::sum(sq_pd);
    sq_args_[DNNL_ARG_DST] = memory(md, eng_, p.sq);
    for (int t = 0; t < towers; ++t) {
      memory scratch(md, eng_);  // owned by oneDNN, allocated here once
      pow_args_.push_back({{DNNL_ARG_SRC, mean_args_[DNNL_ARG_MULTIPLE_SRC + t]},
                           {DNNL_ARG_DST, scratch}});
      sq_args_[DNNL_ARG_MULTIPLE_SRC + t] = scratch;
    }
  }

  void run() override {
    mean_.execute(strm_, mean_args_);
    if (!pow_args_.empty()) {
      for (const auto& args : pow_args_) pow_.execute(strm_, args);
      sq_.execute(strm_, sq_args_);
    }
    strm_.wait();
  }

 private:
  dnnl::engine eng_;
  dnnl::stream strm_;
  dnnl::sum mean_, sq_;
  dnnl::eltwise_forward pow_;
  std::unordered_map<int, memory> mean_args_, sq_args_;
  std::vector<std::unordered_map<int, memory>> pow_args_;
};

}  // namespace

std::unique_ptr<runner> make_onednn_sum(const problem<float>& p) {
  return std::make_unique<onednn_sum<float>>(p);
}

std::unique_ptr<runner> make_onednn_sum_bf16(const problem<Eigen::bfloat16>& p) {
  return std::make_unique<onednn_sum<Eigen::bfloat16>>(p);
}

std::string onednn_bf16_sum_implementation(std::size_t towers, std::size_t elements) {
  try {
    const dnnl::engine eng(dnnl::engine::kind::cpu, 0);
    const memory::desc md({static_cast<memory::dim>(elements)}, memory::data_type::bf16, memory::format_tag::a);
    const dnnl::sum::primitive_desc pd(md, std::vector<float>(towers, 1.0f / static_cast<float>(towers)),
                                       std::vector<memory::desc>(towers, md), eng);
    return pd.impl_info_str();
  } catch (const dnnl::error&) {
    return {};  // dnnl_unimplemented: no implementation on this CPU
  }
}

}  // namespace gradavg_bench
