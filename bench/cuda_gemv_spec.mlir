// An IREE tuning spec for cuda, tried in session 16 and NOT used by the export (docs/performance.md,
// "Session 16"): the routed experts' one-row blocks ([G, 1, K] x [G, N, K], a decode's (token, expert)
// pairs) with four warps per workgroup, each warp one output with IREE's own per-warp loop, where IREE
// 3.13 gives a 32-thread workgroup one output. Bit-identical to the default build on the H200 (Flash-4,
// decode_bs1/8/32/64) and no faster: 19.85 / 48.02 / 74.69 ms at batch 8 / 32 / 64 against 19.87 /
// 48.42 / 74.69. How to try one (IREE 3.13's cuda backend ignores --iree-codegen-tuning-spec-path; it
// reads a transform library):
//   iree-compile ... --iree-codegen-transform-dialect-library=bench/cuda_gemv_spec.mlir@__kernel_config
// Applying the same to the dense one-row GEMVs of a batch-1 decode (matched per K; wo_b, whose result is
// broadcast into the mHC streams in its dispatch, fails to distribute with four outputs per workgroup)
// measured 6.37 -> 5.92 ms at batch 1, but changes their summation order: decode_bs1's logits moved by
// 2.8e-2 (relative) from the default build's on random weights, not kept without a float32 referee.
module attributes {transform.with_named_sequence} {
  transform.named_sequence @apply_op_config(%op: !transform.any_op {transform.readonly},
                                            %config: !transform.any_param {transform.readonly}) {
    transform.annotate %op "compilation_info" = %config : !transform.any_op, !transform.any_param
    transform.yield
  }
  // [G, 1, K] x [G, N, K] -> [G, 1, N] at the experts' shapes (N x K: Flash 2048 x 4096 and 4096 x 2048,
  // Pro 3072 x 7168 and 7168 x 3072). Matched by shape: other one-row batched products (the grouped
  // wo_a, the indexer) get other defaults, which this config would change.
  transform.named_sequence @match_expert_2048x4096(%op: !transform.any_op {transform.readonly}) -> (!transform.any_op, !transform.any_param) {
    transform.iree.match.has_no_lowering_config %op : !transform.any_op
    %batch, %m, %n, %k = transform.iree.match.contraction %op, lhs_type = bf16, rhs_type = bf16, output_type = f32,
      indexing_maps = [affine_map<(d0, d1, d2, d3) -> (d0, d1, d3)>, affine_map<(d0, d1, d2, d3) -> (d0, d2, d3)>,
                       affine_map<(d0, d1, d2, d3) -> (d0, d1, d2)>] : !transform.any_op -> !transform.param<i64>
    transform.iree.match.dims_equal %m, [1] : !transform.param<i64>
    transform.iree.match.dims_equal %n, [2048] : !transform.param<i64>
    transform.iree.match.dims_equal %k, [4096] : !transform.param<i64>
    %config = transform.param.constant #iree_codegen.compilation_info<
      lowering_config = #iree_gpu.lowering_config<{lane_basis = [[1, 1, 1, 32], [0, 1, 2, 3]], partial_reduction = [0, 0, 0, 1024],
        subgroup_basis = [[1, 1, 4, 1], [0, 1, 2, 3]], thread = [0, 0, 0, 32], workgroup = [1, 1, 4, 0]}>,
      translation_info = #iree_codegen.translation_info<pipeline = #iree_gpu.pipeline<VectorDistribute> workgroup_size = [128, 1, 1] subgroup_size = 32>> -> !transform.any_param
    transform.yield %op, %config : !transform.any_op, !transform.any_param
  }
  transform.named_sequence @match_expert_4096x2048(%op: !transform.any_op {transform.readonly}) -> (!transform.any_op, !transform.any_param) {
    transform.iree.match.has_no_lowering_config %op : !transform.any_op
    %batch, %m, %n, %k = transform.iree.match.contraction %op, lhs_type = bf16, rhs_type = bf16, output_type = f32,
      indexing_maps = [affine_map<(d0, d1, d2, d3) -> (d0, d1, d3)>, affine_map<(d0, d1, d2, d3) -> (d0, d2, d3)>,
                       affine_map<(d0, d1, d2, d3) -> (d0, d1, d2)>] : !transform.any_op -> !transform.param<i64>
    transform.iree.match.dims_equal %m, [1] : !transform.param<i64>
    transform.iree.match.dims_equal %n, [4096] : !transform.param<i64>
    transform.iree.match.dims_equal %k, [2048] : !transform.param<i64>
    %config = transform.param.constant #iree_codegen.compilation_info<
      lowering_config = #iree_gpu.lowering_config<{lane_basis = [[1, 1, 1, 32], [0, 1, 2, 3]], partial_reduction = [0, 0, 0, 1024],
        subgroup_basis = [[1, 1, 4, 1], [0, 1, 2, 3]], thread = [0, 0, 0, 32], workgroup = [1, 1, 4, 0]}>,
      translation_info = #iree_codegen.translation_info<pipeline = #iree_gpu.pipeline<VectorDistribute> workgroup_size = [128, 1, 1] subgroup_size = 32>> -> !transform.any_param
    transform.yield %op, %config : !transform.any_op, !transform.any_param
  }
  transform.named_sequence @match_expert_3072x7168(%op: !transform.any_op {transform.readonly}) -> (!transform.any_op, !transform.any_param) {
    transform.iree.match.has_no_lowering_config %op : !transform.any_op
    %batch, %m, %n, %k = transform.iree.match.contraction %op, lhs_type = bf16, rhs_type = bf16, output_type = f32,
      indexing_maps = [affine_map<(d0, d1, d2, d3) -> (d0, d1, d3)>, affine_map<(d0, d1, d2, d3) -> (d0, d2, d3)>,
                       affine_map<(d0, d1, d2, d3) -> (d0, d1, d2)>] : !transform.any_op -> !transform.param<i64>
    transform.iree.match.dims_equal %m, [1] : !transform.param<i64>
    transform.iree.match.dims_equal %n, [3072] : !transform.param<i64>
    transform.iree.match.dims_equal %k, [7168] : !transform.param<i64>
    %config = transform.param.constant #iree_codegen.compilation_info<
      lowering_config = #iree_gpu.lowering_config<{lane_basis = [[1, 1, 1, 32], [0, 1, 2, 3]], partial_reduction = [0, 0, 0, 1024],
        subgroup_basis = [[1, 1, 4, 1], [0, 1, 2, 3]], thread = [0, 0, 0, 32], workgroup = [1, 1, 4, 0]}>,
      translation_info = #iree_codegen.translation_info<pipeline = #iree_gpu.pipeline<VectorDistribute> workgroup_size = [128, 1, 1] subgroup_size = 32>> -> !transform.any_param
    transform.yield %op, %config : !transform.any_op, !transform.any_param
  }
  transform.named_sequence @match_expert_7168x3072(%op: !transform.any_op {transform.readonly}) -> (!transform.any_op, !transform.any_param) {
    transform.iree.match.has_no_lowering_config %op : !transform.any_op
    %batch, %m, %n, %k = transform.iree.match.contraction %op, lhs_type = bf16, rhs_type = bf16, output_type = f32,
      indexing_maps = [affine_map<(d0, d1, d2, d3) -> (d0, d1, d3)>, affine_map<(d0, d1, d2, d3) -> (d0, d2, d3)>,
                       affine_map<(d0, d1, d2, d3) -> (d0, d1, d2)>] : !transform.any_op -> !transform.param<i64>
    transform.iree.match.dims_equal %m, [1] : !transform.param<i64>
    transform.iree.match.dims_equal %n, [7168] : !transform.param<i64>
    transform.iree.match.dims_equal %k, [3072] : !transform.param<i64>
    %config = transform.param.constant #iree_codegen.compilation_info<
      lowering_config = #iree_gpu.lowering_config<{lane_basis = [[1, 1, 1, 32], [0, 1, 2, 3]], partial_reduction = [0, 0, 0, 1024],
        subgroup_basis = [[1, 1, 4, 1], [0, 1, 2, 3]], thread = [0, 0, 0, 32], workgroup = [1, 1, 4, 0]}>,
      translation_info = #iree_codegen.translation_info<pipeline = #iree_gpu.pipeline<VectorDistribute> workgroup_size = [128, 1, 1] subgroup_size = 32>> -> !transform.any_param
    transform.yield %op, %config : !transform.any_op, !transform.any_param
  }
  transform.named_sequence @__kernel_config(%variant: !transform.any_op {transform.consumed}) -> !transform.any_op {
    %res = transform.foreach_match in %variant @match_expert_2048x4096 -> @apply_op_config,
        @match_expert_4096x2048 -> @apply_op_config,
        @match_expert_3072x7168 -> @apply_op_config,
        @match_expert_7168x3072 -> @apply_op_config
      : (!transform.any_op) -> !transform.any_op
    transform.yield %res : !transform.any_op
  }
}
