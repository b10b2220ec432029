"""The launch budget's shape lists are the real models'."""
import math

from horovod_qsgd.testdata.model_shapes import compressed, gpt2_small, resnet50


def test_resnet50_has_torchvisions_tensors_and_parameters():
    shapes = resnet50()
    assert (len(shapes), sum(math.prod(shape) for _, shape in shapes)) == (161, 25_557_032)
    assert len(compressed(shapes)) == 52  # compressed at min_numel=10,000


def test_gpt2_small_has_hugging_faces_tensors_and_parameters():
    shapes = gpt2_small()
    assert (len(shapes), sum(math.prod(shape) for _, shape in shapes)) == (148, 124_439_808)
    assert len(compressed(shapes)) == 50
