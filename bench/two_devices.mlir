// y = (x on device 1) * 2, returned on device 0: two named devices and a transfer each way
module {
  func.func @main(%x: tensor<4xf32>) -> tensor<4xf32> {
    %a = flow.tensor.transfer %x : tensor<4xf32> to #hal.device.promise<@__device_1>
    %b = arith.addf %a, %a : tensor<4xf32>
    %c = flow.tensor.transfer %b : tensor<4xf32> to #hal.device.promise<@__device_0>
    return %c : tensor<4xf32>
  }
}
