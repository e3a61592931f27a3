"""specsplit: lossless speculative decoding served as gRPC microservices."""

__version__ = "0.1.0"
