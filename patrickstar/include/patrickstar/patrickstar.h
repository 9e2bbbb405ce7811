// The one header a trainer includes: the whole public API of patrickstar.
#pragma once

#include "patrickstar/version.h"
