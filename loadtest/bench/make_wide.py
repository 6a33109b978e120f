"""Makes loadtest/bench/ctr_wide.onnx: a benchmark-only model with the demo binding's input (float32
[batch, 27]) and a heavy body (27 -> 1024 ReLU -> 1024 ReLU -> 1 sigmoid, random weights, seed 7).

Its scores mean nothing; it exists so the batching benchmark can show what micro-batching buys when the
forward pass, not the HTTP stack, dominates. Run: python3 loadtest/bench/make_wide.py (numpy, onnx).
"""
import os

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

rng = np.random.default_rng(7)
sizes = [27, 1024, 1024, 1]
nodes, inits = [], []
x = "features"
for i, (a, b) in enumerate(zip(sizes, sizes[1:])):
    w = (rng.standard_normal((a, b)) / np.sqrt(a)).astype(np.float32)
    bias = np.zeros(b, dtype=np.float32)
    inits += [numpy_helper.from_array(w, f"w{i}"), numpy_helper.from_array(bias, f"b{i}")]
    y = f"h{i}"
    nodes.append(helper.make_node("Gemm", [x, f"w{i}", f"b{i}"], [y]))
    x = y
    if i < len(sizes) - 2:
        nodes.append(helper.make_node("Relu", [x], [f"r{i}"]))
        x = f"r{i}"
nodes.append(helper.make_node("Sigmoid", [x], ["score"]))
graph = helper.make_graph(
    nodes,
    "ctr_wide",
    [helper.make_tensor_value_info("features", TensorProto.FLOAT, ["batch", 27])],
    [helper.make_tensor_value_info("score", TensorProto.FLOAT, ["batch", 1])],
    inits,
)
model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], producer_name="hydrant-bench")
model.ir_version = 9
onnx.checker.check_model(model)
out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ctr_wide.onnx")
onnx.save(model, out)
print(out, os.path.getsize(out), "bytes")
