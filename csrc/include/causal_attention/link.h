// Keeps libcausal_attention.so linked into every program that includes a causal_attention header.
//
// The library registers the operators torch.ops.causal_attention.* when it is loaded. A program
// can need them without calling any of the library's functions: one that only runs an
// AOTInductor package or an exported program whose kernels call the ops by name through the
// dispatcher. Linkers that drop unreferenced shared libraries (--as-needed, the default on many
// distributions) would then leave it out, and loading the package fails with "Could not find schema
// for causal_attention::attention_forward". This weak pointer (one definition per program, however many
// translation units include it; the pattern torchvision's vision.h uses) references the library.
#pragma once

namespace causal_attention::kernels {
const char* cpu_capability();
}  // namespace causal_attention::kernels

extern "C" {
__attribute__((weak)) const char* (*causal_attention_keep_linked)() = &causal_attention::kernels::cpu_capability;
}
