// Tile choices for the gfx942 target: iree-compile loads this library with --iree-codegen-transform-dialect-library
// (export/compile.py TUNING_FLAG) and runs its __kernel_config before choosing tiles itself. Each matcher names one
// kernel form of model/kernels by its root op; shapes are matched up to `?`. Not timed on the hardware (none here):
// each config is cuda.mlir's for the same kernel at gfx942's 64-lane wavefront, checked in the generated code
// (docs/kernels.md).
module @dsv4_gfx942_tuning attributes {transform.with_named_sequence, iree_codegen.tuning_spec_with_default_entrypoint} {

  transform.named_sequence @apply_op_config(%op: !transform.any_op {transform.readonly}, %config: !transform.any_param {transform.readonly}) {
    transform.annotate %op "compilation_info" = %config : !transform.any_op, !transform.any_param
    transform.yield
  }

  // The gathered MXFP4 GEMV (quant.mlir.jinja, kernel_gemm / mxfp4_swiglu_gathered with one row a block: decode
  // at batch 1 to 4): an expert's decoded low and high codes [G, N, K/32, 16] each (fused in: the gather of its
  // bytes and their decode) x the row's even and odd elements [G, K/32, 16] -> [G, N] f32. A wavefront (64 lanes) for 4
  // rows, a lane a scale block (16 bytes, one load) of each a step, so the row's activations are read once for
  // the 4. Without a config IREE makes the fused gather the dispatch's root and gives it one thread a row.
  transform.named_sequence @match_gathered_mxfp4_gemv(%root: !transform.any_op {transform.readonly}) -> (!transform.any_op, !transform.any_param) {
    transform.iree.match.has_no_lowering_config %root : !transform.any_op
    %ins, %outs = transform.iree.match.cast_compatible_dag_from_root %root {
    ^bb0(%wl: tensor<?x?x?x16xf32>, %wh: tensor<?x?x?x16xf32>, %xl: tensor<?x?x16xbf16>, %xh: tensor<?x?x16xbf16>, %acc: tensor<?x?xf32>):
      %r = linalg.generic {indexing_maps = [affine_map<(g, n, q, b) -> (g, n, q, b)>, affine_map<(g, n, q, b) -> (g, n, q, b)>,
                                            affine_map<(g, n, q, b) -> (g, q, b)>, affine_map<(g, n, q, b) -> (g, q, b)>,
                                            affine_map<(g, n, q, b) -> (g, n)>],
                           iterator_types = ["parallel", "parallel", "reduction", "reduction"]}
          ins(%wl, %wh, %xl, %xh : tensor<?x?x?x16xf32>, tensor<?x?x?x16xf32>, tensor<?x?x16xbf16>, tensor<?x?x16xbf16>) outs(%acc : tensor<?x?xf32>) {
      ^bb1(%af: f32, %af2: f32, %b: bf16, %b2: bf16, %c: f32):
        %bf = arith.extf %b : bf16 to f32
        %p = arith.mulf %af, %bf : f32
        %bf2 = arith.extf %b2 : bf16 to f32
        %p2 = arith.mulf %af2, %bf2 : f32
        %pp = arith.addf %p, %p2 : f32
        %s = arith.addf %c, %pp : f32
        linalg.yield %s : f32
      } -> tensor<?x?xf32>
    } : (!transform.any_op) -> (!transform.any_value, !transform.any_value)
    %config = transform.param.constant #iree_codegen.compilation_info<
        lowering_config = #iree_gpu.lowering_config<{lane_basis = [[1, 1, 64, 1], [0, 1, 2, 3]], partial_reduction = [0, 0, 64, 16],
          subgroup_basis = [[1, 1, 1, 1], [0, 1, 2, 3]], thread = [0, 4, 1, 16], workgroup = [1, 4, 0, 0]}>,
        translation_info = #iree_codegen.translation_info<pipeline = #iree_gpu.pipeline<VectorDistribute> workgroup_size = [64, 1, 1] subgroup_size = 64>> -> !transform.any_param
    transform.yield %root, %config : !transform.any_op, !transform.any_param
  }

  transform.named_sequence @__kernel_config(%variant: !transform.any_op {transform.consumed}) -> !transform.any_op
      attributes {iree_codegen.tuning_spec_entrypoint} {
    %res = transform.foreach_match in %variant
        @match_gathered_mxfp4_gemv -> @apply_op_config
      : (!transform.any_op) -> !transform.any_op
    transform.yield %res : !transform.any_op
  }
}
