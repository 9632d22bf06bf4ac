#include "transport/soft/early_tx_gate.h"

#include <string_view>

namespace coverbs::transport::soft {

int ParseLoadavgRunnable(std::string_view text) {
  // Skip three fields and their single spaces.
  size_t p = 0;
  for (int spaces = 0; spaces < 3; ++p) {
    if (p >= text.size()) return 0;
    if (text[p] == ' ') ++spaces;
  }
  int n = 0;
  size_t digits = 0;
  for (; p < text.size() && text[p] >= '0' && text[p] <= '9'; ++p, ++digits) {
    if (n > 100000000) return 0;  // not a count of tasks
    n = n * 10 + (text[p] - '0');
  }
  if (digits == 0 || p >= text.size() || text[p] != '/') return 0;
  return n;
}

}  // namespace coverbs::transport::soft
