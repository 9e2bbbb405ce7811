// The one header a trainer includes: the whole public API of patrickstar.
//   Config            engine/config.h      the DeepSpeed-style JSON config
//   initialize_engine initialize.h         model and optimizer handles over an Engine
//   call, ModuleScope engine/module_hooks.h the doors a model's forward goes through
//   checkpoint        engine/checkpoint.h  activation checkpointing (recompute in backward)
//   defer_parameters  engine/deferred_init.h  a model never whole in fp32
//   Engine            engine/engine.h      the runtime itself
#pragma once

#include "patrickstar/engine/checkpoint.h"
#include "patrickstar/engine/checkpoint_files.h"
#include "patrickstar/engine/config.h"
#include "patrickstar/engine/deferred_init.h"
#include "patrickstar/engine/engine.h"
#include "patrickstar/engine/gathered_parameters.h"
#include "patrickstar/engine/module_hooks.h"
#include "patrickstar/engine/safetensors.h"
#include "patrickstar/initialize.h"
#include "patrickstar/version.h"
