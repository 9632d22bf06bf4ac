// The soft provider's type-2 memory windows (ProviderMw), with verbs
// semantics: a bind (IBV_WR_BIND_MW, posted on a QP) gives the window a
// fresh unpredictable rkey usable through that QP alone; the peer's
// SEND_WITH_INV naming it, a LOCAL_INV, or deallocation ends it; any other
// access fails with IBV_WC_REM_ACCESS_ERR. The table side is in
// mr_table.cc, the posting side in qp_post.cc.
#ifndef COVERBS_TRANSPORT_SOFT_SOFT_MW_H_
#define COVERBS_TRANSPORT_SOFT_SOFT_MW_H_

#include <cstdint>
#include <memory>

#include "transport/provider.h"

namespace coverbs::transport::soft {

// An unbound window of PD `pd_id`.
std::unique_ptr<ProviderMw> NewSoftMw(uint64_t pd_id);

}  // namespace coverbs::transport::soft

#endif  // COVERBS_TRANSPORT_SOFT_SOFT_MW_H_
