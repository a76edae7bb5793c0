"""Node checks (DESIGN section 6): io, gpu, runtime, rdma, allreduce, hang."""
