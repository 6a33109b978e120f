"""Writes the small ONNX models the start-up tests refuse (python3 -m pip install onnx numpy).

Each takes the demo binding's 27 float32 columns and is well-formed, yet cannot serve it:
  fixed_batch.onnx     input [1, 27]: runs one row, never a request with several candidates
  two_inputs.onnx      a second required input, `extra`, that the binding does not fill
  symbolic_width.onnx  input [batch, width] with weights for 26 columns: the width shows only when it runs

  batch_mean.onnx      score = (features - their mean over the batch) · W: a row's score depends on the
                       rows run beside it

and one that serves some rows and fails on others, as a model indexing past a table does:
  hour_table.onnx      score = [0.1, 0.2, 0.3][slot 23] (the hour bucket, 0-3): a run holding a row of the
                       evening (bucket 3, hour 18 and later) fails
"""
import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


def save(name, inputs, nodes, weights):
    out = helper.make_tensor_value_info("score", TensorProto.FLOAT, ["batch", 1])
    graph = helper.make_graph(nodes, name, inputs, [out], initializer=[weights])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    onnx.save(model, f"{name}.onnx")


def weights(rows):
    return numpy_helper.from_array(np.full((rows, 1), 0.01, dtype=np.float32), "W")


def features(shape):
    return helper.make_tensor_value_info("features", TensorProto.FLOAT, shape)


matmul = helper.make_node("MatMul", ["features", "W"], ["score"])
save("fixed_batch", [features([1, 27])], [matmul], weights(27))
save(
    "two_inputs",
    [features(["batch", 27]), helper.make_tensor_value_info("extra", TensorProto.FLOAT, ["batch", 1])],
    [helper.make_node("MatMul", ["features", "W"], ["m"]), helper.make_node("Add", ["m", "extra"], ["score"])],
    weights(27),
)
save("symbolic_width", [features(["batch", "width"])], [matmul], weights(26))
save(
    "batch_mean",
    [features(["batch", 27])],
    [
        helper.make_node("ReduceMean", ["features"], ["mean"], axes=[0], keepdims=1),
        helper.make_node("Sub", ["features", "mean"], ["centered"]),
        helper.make_node("MatMul", ["centered", "W"], ["score"]),
    ],
    weights(27),
)

hour = helper.make_tensor_value_info("features", TensorProto.FLOAT, ["batch", 27])
out = helper.make_tensor_value_info("score", TensorProto.FLOAT, ["batch", 1])
graph = helper.make_graph(
    [
        helper.make_node("Gather", ["features", "slot"], ["bucket"], axis=1),
        helper.make_node("Cast", ["bucket"], ["index"], to=TensorProto.INT64),
        helper.make_node("Gather", ["table", "index"], ["score"], axis=0),
    ],
    "hour_table",
    [hour],
    [out],
    initializer=[
        numpy_helper.from_array(np.array([23], dtype=np.int64), "slot"),
        numpy_helper.from_array(np.array([0.1, 0.2, 0.3], dtype=np.float32), "table"),
    ],
)
model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
model.ir_version = 8
onnx.checker.check_model(model)
onnx.save(model, "hour_table.onnx")
