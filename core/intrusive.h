// Small intrusive containers used by the runtime so that waiting never
// allocates: the nodes live inside the awaiting coroutine's frame.
#ifndef COVERBS_CORE_INTRUSIVE_H_
#define COVERBS_CORE_INTRUSIVE_H_

#include <cassert>
#include <cstddef>
#include <vector>

namespace coverbs::internal {

// Doubly linked list node; T derives from ListNode<T>.
template <typename T>
struct ListNode {
  ListNode* prev = nullptr;
  ListNode* next = nullptr;
  bool linked() const { return prev != nullptr; }
};

// FIFO intrusive list with O(1) push_back, pop_front and erase.
template <typename T>
class IntrusiveList {
 public:
  IntrusiveList() { head_.prev = head_.next = &head_; }
  IntrusiveList(const IntrusiveList&) = delete;
  IntrusiveList& operator=(const IntrusiveList&) = delete;

  bool empty() const { return head_.next == &head_; }
  size_t size() const { return size_; }

  void push_back(T* t) {
    ListNode<T>* n = t;
    assert(!n->linked());
    n->prev = head_.prev;
    n->next = &head_;
    head_.prev->next = n;
    head_.prev = n;
    ++size_;
  }
  T* front() { return empty() ? nullptr : static_cast<T*>(head_.next); }
  // O(n): whether `pred` holds for some element (e.g. to check a pointer
  // that may be stale against what the list holds, without dereferencing
  // it).
  template <typename Pred>
  bool AnyOf(Pred pred) const {
    for (const ListNode<T>* n = head_.next; n != &head_; n = n->next) {
      if (pred(static_cast<const T*>(n))) return true;
    }
    return false;
  }
  T* pop_front() {
    T* t = front();
    if (t) erase(t);
    return t;
  }
  void erase(T* t) {
    ListNode<T>* n = t;
    assert(n->linked());
    n->prev->next = n->next;
    n->next->prev = n->prev;
    n->prev = n->next = nullptr;
    --size_;
  }

 private:
  ListNode<T> head_;
  size_t size_ = 0;
};

// Binary min-heap of node pointers; each node remembers its index so it can
// be removed in O(log n) when a timer is cancelled. Less(a, b) orders nodes.
template <typename T, typename Less>
class IndexedHeap {
 public:
  static constexpr size_t kNotInHeap = static_cast<size_t>(-1);

  bool empty() const { return v_.empty(); }
  size_t size() const { return v_.size(); }
  T* top() const { return v_.empty() ? nullptr : v_.front(); }

  void push(T* t) {
    t->heap_index = v_.size();
    v_.push_back(t);
    SiftUp(v_.size() - 1);
  }
  void erase(T* t) {
    size_t i = t->heap_index;
    assert(i < v_.size() && v_[i] == t);
    size_t last = v_.size() - 1;
    if (i != last) {
      Swap(i, last);
      v_.pop_back();
      if (!SiftUp(i)) SiftDown(i);
    } else {
      v_.pop_back();
    }
    t->heap_index = kNotInHeap;
  }
  T* pop() {
    T* t = top();
    if (t) erase(t);
    return t;
  }

 private:
  void Swap(size_t a, size_t b) {
    std::swap(v_[a], v_[b]);
    v_[a]->heap_index = a;
    v_[b]->heap_index = b;
  }
  bool SiftUp(size_t i) {
    bool moved = false;
    while (i > 0) {
      size_t p = (i - 1) / 2;
      if (!Less()(v_[i], v_[p])) break;
      Swap(i, p);
      i = p;
      moved = true;
    }
    return moved;
  }
  void SiftDown(size_t i) {
    for (;;) {
      size_t l = 2 * i + 1, r = l + 1, m = i;
      if (l < v_.size() && Less()(v_[l], v_[m])) m = l;
      if (r < v_.size() && Less()(v_[r], v_[m])) m = r;
      if (m == i) return;
      Swap(i, m);
      i = m;
    }
  }
  std::vector<T*> v_;
};

}  // namespace coverbs::internal

#endif  // COVERBS_CORE_INTRUSIVE_H_
