"""lifl's network wire formats, shared by the gateway and the client SDK: the HTTP/2 codec
(``lifl.net.h2``), gRPC's message framing on top of it (``lifl.net.grpc``), and the gateway
API's messages (``lifl.proto``, compiled by ``make proto`` into ``lifl_pb2`` and ``lifl_pb2_grpc``)."""
