// Tile choices for the cuda target: iree-compile loads this library with --iree-codegen-transform-dialect-library
// (export/compile.py TUNING_FLAG) and runs its __kernel_config before choosing tiles itself.
// Each matcher names one kernel form of model/kernels by its root op; shapes are matched up to `?`.
// The timings that chose each config: docs/kernels.md, Tuned tiles on cuda.
module @dsv4_cuda_tuning attributes {transform.with_named_sequence, iree_codegen.tuning_spec_with_default_entrypoint} {

  transform.named_sequence @apply_op_config(%op: !transform.any_op {transform.readonly}, %config: !transform.any_param {transform.readonly}) {
    transform.annotate %op "compilation_info" = %config : !transform.any_op, !transform.any_param
    transform.yield
  }

  // The gathered MXFP4 block GEMM (quant.mlir.jinja, kernel_gemm / mxfp4_swiglu_gathered) of a prefill's
  // 64-row blocks: rows [G, 64, K/32, 32] x decoded expert [G, N, K/32, 32] -> [G, 64, N] f32. IREE's
  // choice, 32 columns a workgroup, reads the block's 64 x K activation (512 KB at K 4,096) once per 32
  // columns. A decode's 16-row blocks keep IREE's choice: 128 columns did not change Flash-4's batch 64.
  transform.named_sequence @match_gathered_mxfp4_rows64(%root: !transform.any_op {transform.readonly}) -> (!transform.any_op, !transform.any_param) {
    transform.iree.match.has_no_lowering_config %root : !transform.any_op
    %ins, %outs = transform.iree.match.cast_compatible_dag_from_root %root {
    ^bb0(%x: tensor<?x64x?x32xbf16>, %w: tensor<?x?x?x32xbf16>, %acc: tensor<?x64x?xf32>):
      %r = linalg.generic {indexing_maps = [affine_map<(g, m, n, q, j) -> (g, m, q, j)>, affine_map<(g, m, n, q, j) -> (g, n, q, j)>,
                                            affine_map<(g, m, n, q, j) -> (g, m, n)>],
                           iterator_types = ["parallel", "parallel", "parallel", "reduction", "reduction"]}
          ins(%x, %w : tensor<?x64x?x32xbf16>, tensor<?x?x?x32xbf16>) outs(%acc : tensor<?x64x?xf32>) {
      ^bb1(%a: bf16, %b: bf16, %c: f32):
        %af = arith.extf %a : bf16 to f32
        %bf = arith.extf %b : bf16 to f32
        %p = arith.mulf %af, %bf : f32
        %s = arith.addf %c, %p : f32
        linalg.yield %s : f32
      } -> tensor<?x64x?xf32>
    } : (!transform.any_op) -> (!transform.any_value, !transform.any_value)
    %config = transform.param.constant #iree_codegen.compilation_info<
        lowering_config = #iree_gpu.lowering_config<{convert_acc_gemm, mma_kind = #iree_gpu.mma_layout<NV_MMA_SYNC_F32_16x8x16_BF16>,
          promote_operands = [0, 1], reduction = [0, 0, 0, 4, 2], subgroup = [0, 2, 8, 0, 0], workgroup = [1, 64, 128, 0, 0]}>,
        translation_info = #iree_codegen.translation_info<pipeline = #iree_gpu.pipeline<TileAndFuse> workgroup_size = [128, 1, 1] subgroup_size = 32,
          {gpu_pipeline_options = #iree_gpu.pipeline_options<prefetch_num_stages = 2, no_reduce_shared_memory_bank_conflicts = false, use_igemm_convolution = false>}>> -> !transform.any_param
    transform.yield %root, %config : !transform.any_op, !transform.any_param
  }

  // The gathered MXFP4 GEMV (quant.mlir.jinja, kernel_gemm / mxfp4_swiglu_gathered with one row a block: decode
  // at batch 1 to 4): an expert's decoded low and high codes [G, N, K/32, 16] each (fused in: the gather of its
  // bytes and their decode) x the row's even and odd elements [G, K/32, 16] -> [G, N] f32. A warp (32 lanes) for 4
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
        lowering_config = #iree_gpu.lowering_config<{lane_basis = [[1, 1, 32, 1], [0, 1, 2, 3]], partial_reduction = [0, 0, 32, 16],
          subgroup_basis = [[1, 1, 1, 1], [0, 1, 2, 3]], thread = [0, 4, 1, 16], workgroup = [1, 4, 0, 0]}>,
        translation_info = #iree_codegen.translation_info<pipeline = #iree_gpu.pipeline<VectorDistribute> workgroup_size = [32, 1, 1] subgroup_size = 32>> -> !transform.any_param
    transform.yield %root, %config : !transform.any_op, !transform.any_param
  }

  transform.named_sequence @__kernel_config(%variant: !transform.any_op {transform.consumed}) -> !transform.any_op
      attributes {iree_codegen.tuning_spec_entrypoint} {
    %res = transform.foreach_match in %variant
        @match_gathered_mxfp4_rows64 -> @apply_op_config,
        @match_gathered_mxfp4_gemv -> @apply_op_config
      : (!transform.any_op) -> !transform.any_op
    transform.yield %res : !transform.any_op
  }
}
