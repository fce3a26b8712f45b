// Shared by the kernels' sources (compiled into one library by loader.py).
#pragma once

// A row's loop stays a function of its own: inlined into the loop over rows, g++ vectorizes
// across rows instead of along the row and the kernel runs about 4x slower.
#if defined(__GNUC__)
#define MANIFOLDLIB_ROW_KERNEL __attribute__((noinline))
#else
#define MANIFOLDLIB_ROW_KERNEL
#endif
