"""Number formats (FP8 e4m3fn / e4m3fnuz, MXFP4, UE8M0 scales), the quantizers into them, and the
quantization-aware simulations the model runs."""
