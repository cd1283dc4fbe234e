#include "copy_engine.h"

namespace rp {

const char* queue_name(CopyQueue q) {
  switch (q) {
    case CopyQueue::ActUp: return "act_up";
    case CopyQueue::ActDown: return "act_down";
    case CopyQueue::ParamUp: return "param_up";
    case CopyQueue::GradDown: return "grad_down";
  }
  return "?";
}

}  // namespace rp
