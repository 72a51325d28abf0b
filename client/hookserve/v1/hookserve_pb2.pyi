from google.rpc import status_pb2 as _status_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    DTYPE_FLOAT32: _ClassVar[DType]
    DTYPE_FLOAT16: _ClassVar[DType]
    DTYPE_BFLOAT16: _ClassVar[DType]

class Reduction(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    REDUCTION_UNSPECIFIED: _ClassVar[Reduction]
    REDUCTION_NONE: _ClassVar[Reduction]
    REDUCTION_AVG_POOL: _ClassVar[Reduction]
    REDUCTION_MAX_POOL: _ClassVar[Reduction]
    REDUCTION_FLATTEN: _ClassVar[Reduction]
    REDUCTION_STATS: _ClassVar[Reduction]
    REDUCTION_CLS: _ClassVar[Reduction]

class Layout(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    LAYOUT_UNSPECIFIED: _ClassVar[Layout]
    LAYOUT_CHW: _ClassVar[Layout]
    LAYOUT_HWC: _ClassVar[Layout]
    LAYOUT_TD: _ClassVar[Layout]
    LAYOUT_D: _ClassVar[Layout]

class AttributionMethod(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ATTRIBUTION_METHOD_UNSPECIFIED: _ClassVar[AttributionMethod]
    ATTRIBUTION_METHOD_GRAD_CAM: _ClassVar[AttributionMethod]
    ATTRIBUTION_METHOD_HIRES_CAM: _ClassVar[AttributionMethod]
    ATTRIBUTION_METHOD_LAYER_CAM: _ClassVar[AttributionMethod]
    ATTRIBUTION_METHOD_GRADIENT: _ClassVar[AttributionMethod]
    ATTRIBUTION_METHOD_GRADIENT_X_INPUT: _ClassVar[AttributionMethod]
    ATTRIBUTION_METHOD_INTEGRATED_GRADIENTS: _ClassVar[AttributionMethod]
    ATTRIBUTION_METHOD_SMOOTH_GRAD: _ClassVar[AttributionMethod]

class AttributionScore(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ATTRIBUTION_SCORE_UNSPECIFIED: _ClassVar[AttributionScore]
    ATTRIBUTION_SCORE_LOGIT: _ClassVar[AttributionScore]
    ATTRIBUTION_SCORE_SOFTMAX: _ClassVar[AttributionScore]

class AttributionBaseline(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ATTRIBUTION_BASELINE_UNSPECIFIED: _ClassVar[AttributionBaseline]
    ATTRIBUTION_BASELINE_ZEROS: _ClassVar[AttributionBaseline]
    ATTRIBUTION_BASELINE_BLACK: _ClassVar[AttributionBaseline]
DTYPE_UNSPECIFIED: DType
DTYPE_FLOAT32: DType
DTYPE_FLOAT16: DType
DTYPE_BFLOAT16: DType
REDUCTION_UNSPECIFIED: Reduction
REDUCTION_NONE: Reduction
REDUCTION_AVG_POOL: Reduction
REDUCTION_MAX_POOL: Reduction
REDUCTION_FLATTEN: Reduction
REDUCTION_STATS: Reduction
REDUCTION_CLS: Reduction
LAYOUT_UNSPECIFIED: Layout
LAYOUT_CHW: Layout
LAYOUT_HWC: Layout
LAYOUT_TD: Layout
LAYOUT_D: Layout
ATTRIBUTION_METHOD_UNSPECIFIED: AttributionMethod
ATTRIBUTION_METHOD_GRAD_CAM: AttributionMethod
ATTRIBUTION_METHOD_HIRES_CAM: AttributionMethod
ATTRIBUTION_METHOD_LAYER_CAM: AttributionMethod
ATTRIBUTION_METHOD_GRADIENT: AttributionMethod
ATTRIBUTION_METHOD_GRADIENT_X_INPUT: AttributionMethod
ATTRIBUTION_METHOD_INTEGRATED_GRADIENTS: AttributionMethod
ATTRIBUTION_METHOD_SMOOTH_GRAD: AttributionMethod
ATTRIBUTION_SCORE_UNSPECIFIED: AttributionScore
ATTRIBUTION_SCORE_LOGIT: AttributionScore
ATTRIBUTION_SCORE_SOFTMAX: AttributionScore
ATTRIBUTION_BASELINE_UNSPECIFIED: AttributionBaseline
ATTRIBUTION_BASELINE_ZEROS: AttributionBaseline
ATTRIBUTION_BASELINE_BLACK: AttributionBaseline

class LayerRequest(_message.Message):
    __slots__ = ("name", "reduction", "dtype", "l2_normalize")
    NAME_FIELD_NUMBER: _ClassVar[int]
    REDUCTION_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    L2_NORMALIZE_FIELD_NUMBER: _ClassVar[int]
    name: str
    reduction: Reduction
    dtype: DType
    l2_normalize: bool
    def __init__(self, name: _Optional[str] = ..., reduction: _Optional[_Union[Reduction, str]] = ..., dtype: _Optional[_Union[DType, str]] = ..., l2_normalize: _Optional[bool] = ...) -> None: ...

class Preprocessing(_message.Message):
    __slots__ = ("mode", "resize", "crop_height", "crop_width")
    class Mode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        MODE_UNSPECIFIED: _ClassVar[Preprocessing.Mode]
        MODE_DEFAULT: _ClassVar[Preprocessing.Mode]
        MODE_RESIZE_CROP: _ClassVar[Preprocessing.Mode]
        MODE_NATIVE: _ClassVar[Preprocessing.Mode]
    MODE_UNSPECIFIED: Preprocessing.Mode
    MODE_DEFAULT: Preprocessing.Mode
    MODE_RESIZE_CROP: Preprocessing.Mode
    MODE_NATIVE: Preprocessing.Mode
    MODE_FIELD_NUMBER: _ClassVar[int]
    RESIZE_FIELD_NUMBER: _ClassVar[int]
    CROP_HEIGHT_FIELD_NUMBER: _ClassVar[int]
    CROP_WIDTH_FIELD_NUMBER: _ClassVar[int]
    mode: Preprocessing.Mode
    resize: int
    crop_height: int
    crop_width: int
    def __init__(self, mode: _Optional[_Union[Preprocessing.Mode, str]] = ..., resize: _Optional[int] = ..., crop_height: _Optional[int] = ..., crop_width: _Optional[int] = ...) -> None: ...

class ExtractionSpec(_message.Message):
    __slots__ = ("model", "layers", "preprocessing")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    PREPROCESSING_FIELD_NUMBER: _ClassVar[int]
    model: str
    layers: _containers.RepeatedCompositeFieldContainer[LayerRequest]
    preprocessing: Preprocessing
    def __init__(self, model: _Optional[str] = ..., layers: _Optional[_Iterable[_Union[LayerRequest, _Mapping]]] = ..., preprocessing: _Optional[_Union[Preprocessing, _Mapping]] = ...) -> None: ...

class RawImage(_message.Message):
    __slots__ = ("pixels", "height", "width")
    PIXELS_FIELD_NUMBER: _ClassVar[int]
    HEIGHT_FIELD_NUMBER: _ClassVar[int]
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    pixels: bytes
    height: int
    width: int
    def __init__(self, pixels: _Optional[bytes] = ..., height: _Optional[int] = ..., width: _Optional[int] = ...) -> None: ...

class Image(_message.Message):
    __slots__ = ("id", "encoded", "raw")
    ID_FIELD_NUMBER: _ClassVar[int]
    ENCODED_FIELD_NUMBER: _ClassVar[int]
    RAW_FIELD_NUMBER: _ClassVar[int]
    id: str
    encoded: bytes
    raw: RawImage
    def __init__(self, id: _Optional[str] = ..., encoded: _Optional[bytes] = ..., raw: _Optional[_Union[RawImage, _Mapping]] = ...) -> None: ...

class ExtractRequest(_message.Message):
    __slots__ = ("spec", "image")
    SPEC_FIELD_NUMBER: _ClassVar[int]
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    spec: ExtractionSpec
    image: Image
    def __init__(self, spec: _Optional[_Union[ExtractionSpec, _Mapping]] = ..., image: _Optional[_Union[Image, _Mapping]] = ...) -> None: ...

class ExtractImageRequest(_message.Message):
    __slots__ = ("spec", "image")
    SPEC_FIELD_NUMBER: _ClassVar[int]
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    spec: ExtractionSpec
    image: Image
    def __init__(self, spec: _Optional[_Union[ExtractionSpec, _Mapping]] = ..., image: _Optional[_Union[Image, _Mapping]] = ...) -> None: ...

class TensorChunk(_message.Message):
    __slots__ = ("layer", "dtype", "shape", "total_bytes", "offset", "data", "columns", "cached")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    COLUMNS_FIELD_NUMBER: _ClassVar[int]
    CACHED_FIELD_NUMBER: _ClassVar[int]
    layer: str
    dtype: DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    total_bytes: int
    offset: int
    data: bytes
    columns: _containers.RepeatedScalarFieldContainer[str]
    cached: bool
    def __init__(self, layer: _Optional[str] = ..., dtype: _Optional[_Union[DType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., total_bytes: _Optional[int] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ..., columns: _Optional[_Iterable[str]] = ..., cached: _Optional[bool] = ...) -> None: ...

class ExtractResponse(_message.Message):
    __slots__ = ("image_id", "image_index", "tensor", "status")
    IMAGE_ID_FIELD_NUMBER: _ClassVar[int]
    IMAGE_INDEX_FIELD_NUMBER: _ClassVar[int]
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    image_id: str
    image_index: int
    tensor: TensorChunk
    status: _status_pb2.Status
    def __init__(self, image_id: _Optional[str] = ..., image_index: _Optional[int] = ..., tensor: _Optional[_Union[TensorChunk, _Mapping]] = ..., status: _Optional[_Union[_status_pb2.Status, _Mapping]] = ...) -> None: ...

class ListModelsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListModelsResponse(_message.Message):
    __slots__ = ("models",)
    MODELS_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[ModelInfo]
    def __init__(self, models: _Optional[_Iterable[_Union[ModelInfo, _Mapping]]] = ...) -> None: ...

class WeightsInfo(_message.Message):
    __slots__ = ("source", "name", "digest", "pretrained", "verified")
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    PRETRAINED_FIELD_NUMBER: _ClassVar[int]
    VERIFIED_FIELD_NUMBER: _ClassVar[int]
    source: str
    name: str
    digest: str
    pretrained: bool
    verified: bool
    def __init__(self, source: _Optional[str] = ..., name: _Optional[str] = ..., digest: _Optional[str] = ..., pretrained: _Optional[bool] = ..., verified: _Optional[bool] = ...) -> None: ...

class PreprocessingInfo(_message.Message):
    __slots__ = ("resize", "crop_height", "crop_width", "mean", "std", "interpolation")
    RESIZE_FIELD_NUMBER: _ClassVar[int]
    CROP_HEIGHT_FIELD_NUMBER: _ClassVar[int]
    CROP_WIDTH_FIELD_NUMBER: _ClassVar[int]
    MEAN_FIELD_NUMBER: _ClassVar[int]
    STD_FIELD_NUMBER: _ClassVar[int]
    INTERPOLATION_FIELD_NUMBER: _ClassVar[int]
    resize: int
    crop_height: int
    crop_width: int
    mean: _containers.RepeatedScalarFieldContainer[float]
    std: _containers.RepeatedScalarFieldContainer[float]
    interpolation: str
    def __init__(self, resize: _Optional[int] = ..., crop_height: _Optional[int] = ..., crop_width: _Optional[int] = ..., mean: _Optional[_Iterable[float]] = ..., std: _Optional[_Iterable[float]] = ..., interpolation: _Optional[str] = ...) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("name", "architecture", "weights", "device", "dtype", "preprocessing", "num_classes", "labels", "default_cam_layer", "precision")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    PREPROCESSING_FIELD_NUMBER: _ClassVar[int]
    NUM_CLASSES_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_CAM_LAYER_FIELD_NUMBER: _ClassVar[int]
    PRECISION_FIELD_NUMBER: _ClassVar[int]
    name: str
    architecture: str
    weights: WeightsInfo
    device: str
    dtype: DType
    preprocessing: PreprocessingInfo
    num_classes: int
    labels: _containers.RepeatedScalarFieldContainer[str]
    default_cam_layer: str
    precision: str
    def __init__(self, name: _Optional[str] = ..., architecture: _Optional[str] = ..., weights: _Optional[_Union[WeightsInfo, _Mapping]] = ..., device: _Optional[str] = ..., dtype: _Optional[_Union[DType, str]] = ..., preprocessing: _Optional[_Union[PreprocessingInfo, _Mapping]] = ..., num_classes: _Optional[int] = ..., labels: _Optional[_Iterable[str]] = ..., default_cam_layer: _Optional[str] = ..., precision: _Optional[str] = ...) -> None: ...

class DescribeModelRequest(_message.Message):
    __slots__ = ("model", "input_height", "input_width")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    INPUT_HEIGHT_FIELD_NUMBER: _ClassVar[int]
    INPUT_WIDTH_FIELD_NUMBER: _ClassVar[int]
    model: str
    input_height: int
    input_width: int
    def __init__(self, model: _Optional[str] = ..., input_height: _Optional[int] = ..., input_width: _Optional[int] = ...) -> None: ...

class LayerInfo(_message.Message):
    __slots__ = ("name", "module", "type", "output_shape", "dtype", "bytes_per_image", "order", "input_shape", "input_bytes_per_image", "layout", "input_layout")
    NAME_FIELD_NUMBER: _ClassVar[int]
    MODULE_FIELD_NUMBER: _ClassVar[int]
    TYPE_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    BYTES_PER_IMAGE_FIELD_NUMBER: _ClassVar[int]
    ORDER_FIELD_NUMBER: _ClassVar[int]
    INPUT_SHAPE_FIELD_NUMBER: _ClassVar[int]
    INPUT_BYTES_PER_IMAGE_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    INPUT_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    name: str
    module: str
    type: str
    output_shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: DType
    bytes_per_image: int
    order: int
    input_shape: _containers.RepeatedScalarFieldContainer[int]
    input_bytes_per_image: int
    layout: Layout
    input_layout: Layout
    def __init__(self, name: _Optional[str] = ..., module: _Optional[str] = ..., type: _Optional[str] = ..., output_shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[_Union[DType, str]] = ..., bytes_per_image: _Optional[int] = ..., order: _Optional[int] = ..., input_shape: _Optional[_Iterable[int]] = ..., input_bytes_per_image: _Optional[int] = ..., layout: _Optional[_Union[Layout, str]] = ..., input_layout: _Optional[_Union[Layout, str]] = ...) -> None: ...

class DescribeModelResponse(_message.Message):
    __slots__ = ("model", "input_height", "input_width", "layers", "gradient_bytes_per_image", "max_message_bytes")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    INPUT_HEIGHT_FIELD_NUMBER: _ClassVar[int]
    INPUT_WIDTH_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    GRADIENT_BYTES_PER_IMAGE_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    model: ModelInfo
    input_height: int
    input_width: int
    layers: _containers.RepeatedCompositeFieldContainer[LayerInfo]
    gradient_bytes_per_image: int
    max_message_bytes: int
    def __init__(self, model: _Optional[_Union[ModelInfo, _Mapping]] = ..., input_height: _Optional[int] = ..., input_width: _Optional[int] = ..., layers: _Optional[_Iterable[_Union[LayerInfo, _Mapping]]] = ..., gradient_bytes_per_image: _Optional[int] = ..., max_message_bytes: _Optional[int] = ...) -> None: ...

class AttributionSpec(_message.Message):
    __slots__ = ("model", "layer", "method", "score", "top_k", "preprocessing", "relu", "normalize", "upsample", "ig_steps", "ig_baseline", "sg_samples", "sg_sigma", "sg_seed")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    METHOD_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    PREPROCESSING_FIELD_NUMBER: _ClassVar[int]
    RELU_FIELD_NUMBER: _ClassVar[int]
    NORMALIZE_FIELD_NUMBER: _ClassVar[int]
    UPSAMPLE_FIELD_NUMBER: _ClassVar[int]
    IG_STEPS_FIELD_NUMBER: _ClassVar[int]
    IG_BASELINE_FIELD_NUMBER: _ClassVar[int]
    SG_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    SG_SIGMA_FIELD_NUMBER: _ClassVar[int]
    SG_SEED_FIELD_NUMBER: _ClassVar[int]
    model: str
    layer: str
    method: AttributionMethod
    score: AttributionScore
    top_k: int
    preprocessing: Preprocessing
    relu: bool
    normalize: bool
    upsample: bool
    ig_steps: int
    ig_baseline: AttributionBaseline
    sg_samples: int
    sg_sigma: float
    sg_seed: int
    def __init__(self, model: _Optional[str] = ..., layer: _Optional[str] = ..., method: _Optional[_Union[AttributionMethod, str]] = ..., score: _Optional[_Union[AttributionScore, str]] = ..., top_k: _Optional[int] = ..., preprocessing: _Optional[_Union[Preprocessing, _Mapping]] = ..., relu: _Optional[bool] = ..., normalize: _Optional[bool] = ..., upsample: _Optional[bool] = ..., ig_steps: _Optional[int] = ..., ig_baseline: _Optional[_Union[AttributionBaseline, str]] = ..., sg_samples: _Optional[int] = ..., sg_sigma: _Optional[float] = ..., sg_seed: _Optional[int] = ...) -> None: ...

class AttributeImage(_message.Message):
    __slots__ = ("image", "target_class")
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    TARGET_CLASS_FIELD_NUMBER: _ClassVar[int]
    image: Image
    target_class: int
    def __init__(self, image: _Optional[_Union[Image, _Mapping]] = ..., target_class: _Optional[int] = ...) -> None: ...

class AttributeRequest(_message.Message):
    __slots__ = ("spec", "image")
    SPEC_FIELD_NUMBER: _ClassVar[int]
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    spec: AttributionSpec
    image: AttributeImage
    def __init__(self, spec: _Optional[_Union[AttributionSpec, _Mapping]] = ..., image: _Optional[_Union[AttributeImage, _Mapping]] = ...) -> None: ...

class ClassScore(_message.Message):
    __slots__ = ("class_index", "logit", "probability", "label")
    CLASS_INDEX_FIELD_NUMBER: _ClassVar[int]
    LOGIT_FIELD_NUMBER: _ClassVar[int]
    PROBABILITY_FIELD_NUMBER: _ClassVar[int]
    LABEL_FIELD_NUMBER: _ClassVar[int]
    class_index: int
    logit: float
    probability: float
    label: str
    def __init__(self, class_index: _Optional[int] = ..., logit: _Optional[float] = ..., probability: _Optional[float] = ..., label: _Optional[str] = ...) -> None: ...

class AttributionTarget(_message.Message):
    __slots__ = ("target", "map_min", "map_max", "completeness_delta")
    TARGET_FIELD_NUMBER: _ClassVar[int]
    MAP_MIN_FIELD_NUMBER: _ClassVar[int]
    MAP_MAX_FIELD_NUMBER: _ClassVar[int]
    COMPLETENESS_DELTA_FIELD_NUMBER: _ClassVar[int]
    target: ClassScore
    map_min: float
    map_max: float
    completeness_delta: float
    def __init__(self, target: _Optional[_Union[ClassScore, _Mapping]] = ..., map_min: _Optional[float] = ..., map_max: _Optional[float] = ..., completeness_delta: _Optional[float] = ...) -> None: ...

class AttributionSummary(_message.Message):
    __slots__ = ("targets", "top5")
    TARGETS_FIELD_NUMBER: _ClassVar[int]
    TOP5_FIELD_NUMBER: _ClassVar[int]
    targets: _containers.RepeatedCompositeFieldContainer[AttributionTarget]
    top5: _containers.RepeatedCompositeFieldContainer[ClassScore]
    def __init__(self, targets: _Optional[_Iterable[_Union[AttributionTarget, _Mapping]]] = ..., top5: _Optional[_Iterable[_Union[ClassScore, _Mapping]]] = ...) -> None: ...

class AttributeResponse(_message.Message):
    __slots__ = ("image_id", "image_index", "summary", "map", "status")
    IMAGE_ID_FIELD_NUMBER: _ClassVar[int]
    IMAGE_INDEX_FIELD_NUMBER: _ClassVar[int]
    SUMMARY_FIELD_NUMBER: _ClassVar[int]
    MAP_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    image_id: str
    image_index: int
    summary: AttributionSummary
    map: TensorChunk
    status: _status_pb2.Status
    def __init__(self, image_id: _Optional[str] = ..., image_index: _Optional[int] = ..., summary: _Optional[_Union[AttributionSummary, _Mapping]] = ..., map: _Optional[_Union[TensorChunk, _Mapping]] = ..., status: _Optional[_Union[_status_pb2.Status, _Mapping]] = ...) -> None: ...
