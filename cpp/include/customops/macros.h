// Export macro for the public C++ API of libcustomops.so (built with hidden visibility).
#pragma once

#if defined(CUSTOMOPS_BUILDING_LIBRARY)
#define CUSTOMOPS_API __attribute__((visibility("default")))
#else
#define CUSTOMOPS_API
#endif
