// strata cyext: host helpers shared by the GPU translation units (strata_kernels.cu defines them).
#pragma once

namespace strata {
void gpu_set_last_kernel(const char* name);  // what strata_gpu_last_kernel() reports
int gpu_use_device(int device);              // make `device` current; 0 or the error code
bool gpu_device_has_pdl(int device);  // programmatic dependent launches (sm_90+, not HIP)
}  // namespace strata
