"""lifl's network layer, shared by the gateway, the nodes that start it and the client SDK: the
HTTP/2 codec (``lifl.net.h2``), gRPC's message framing on top of it (``lifl.net.grpc``), the
gateway API's messages (``lifl.proto``, compiled by ``make proto`` into ``lifl_pb2`` and
``lifl_pb2_grpc``), TLS (``lifl.net.tls``), and what a server's peers may hold
(``lifl.net.limits``) with the flags that set it and TLS (``lifl.net.flags``)."""
