"""lifl's network wire formats, shared by the gateway and the client SDK: the HTTP/2 codec
(``lifl.net.h2``) and gRPC's message framing on top of it (``lifl.net.grpc``)."""
