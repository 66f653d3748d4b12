// Tile choices for the gfx942 target: iree-compile loads this library with --iree-codegen-transform-dialect-library
// (export/compile.py TUNING_FLAG) and runs its __kernel_config before choosing tiles itself.
// Each matcher names one kernel form of model/kernels by its root op; shapes are matched up to `?`.
// Verified by compiling and reading the code objects (docs/kernels.md, The routed MoE); no MI300X timed it.
module @dsv4_gfx942_tuning attributes {transform.with_named_sequence, iree_codegen.tuning_spec_with_default_entrypoint} {

  transform.named_sequence @apply_op_config(%op: !transform.any_op {transform.readonly}, %config: !transform.any_param {transform.readonly}) {
    transform.annotate %op "compilation_info" = %config : !transform.any_op, !transform.any_param
    transform.yield
  }

  // The one-row gathered MXFP4 GEMV (quant.mlir.jinja, kernel_gemm with one row a block: decode's pairs at
  // batch 1 to 4): decoded experts [G, N, S, T, 32] x activation [G, T, S, 32] -> partial sums [G, N, S].
  // One thread a (pair, row, part s): 4 rows x S parts a workgroup, each step one scale block (a 16-byte
  // load of 32 codes, its scale, 32 activations). IREE's own choice (VectorDistribute, one weight a lane a
  // step over the block's 32) is no vector load, and on gfx942 an i4 gather it cannot lower.
  transform.named_sequence @match_gathered_mxfp4_gemv(%root: !transform.any_op {transform.readonly}) -> (!transform.any_op, !transform.any_param) {
    transform.iree.match.has_no_lowering_config %root : !transform.any_op
    %ins, %outs = transform.iree.match.cast_compatible_dag_from_root %root {
    ^bb0(%w: tensor<?x?x?x?x32xf32>, %x: tensor<?x?x?x32xf32>, %acc: tensor<?x?x?xf32>):
      %r = linalg.generic {indexing_maps = [affine_map<(g, n, s, t, j) -> (g, n, s, t, j)>, affine_map<(g, n, s, t, j) -> (g, t, s, j)>,
                                            affine_map<(g, n, s, t, j) -> (g, n, s)>],
                           iterator_types = ["parallel", "parallel", "parallel", "reduction", "reduction"]}
          ins(%w, %x : tensor<?x?x?x?x32xf32>, tensor<?x?x?x32xf32>) outs(%acc : tensor<?x?x?xf32>) {
      ^bb1(%a: f32, %b: f32, %c: f32):
        %p = arith.mulf %a, %b : f32
        %s = arith.addf %c, %p : f32
        linalg.yield %s : f32
      } -> tensor<?x?x?xf32>
    } : (!transform.any_op) -> (!transform.any_value, !transform.any_value)
    %config = transform.param.constant #iree_codegen.compilation_info<
        lowering_config = #iree_gpu.lowering_config<{workgroup = [1, 4, 32, 0, 0], thread = [1, 1, 1, 0, 0], reduction = [0, 0, 0, 1, 32]}>,
        translation_info = #iree_codegen.translation_info<pipeline = #iree_gpu.pipeline<TileAndFuse> workgroup_size = [128, 1, 1] subgroup_size = 64>> -> !transform.any_param
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
