"""The Open Inference Protocol over gRPC (GRPCInferenceService), beside gateway.http: it
translates to the same core."""
