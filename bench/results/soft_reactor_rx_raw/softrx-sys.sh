#!/bin/bash
# usage: softrx-sys.sh BINDIR CALLS SIZE: syscall counts per call, server and client
B=$1; N=${2:-50000}; S=${3:-64}
w=$(mktemp -d)
EV=task-clock,context-switches,syscalls:sys_enter_sendmsg,syscalls:sys_enter_recvfrom,syscalls:sys_enter_write,syscalls:sys_enter_read,syscalls:sys_enter_io_uring_enter,syscalls:sys_enter_futex,syscalls:sys_enter_readv,syscalls:sys_enter_epoll_wait
perf stat -x, -e $EV -o $w/srv.perf $B/echo_server --address=127.0.0.1 --port=0 --port_file=$w/port >$w/srv.out 2>&1 &
sp=$!
for i in $(seq 1 200); do [ -s $w/port ] && break; sleep 0.05; done
perf stat -x, -e $EV -o $w/cli.perf $B/echo_client --server=127.0.0.1 --port=$(cat $w/port) --sizes=$S --calls=$N --concurrency=16 --connections=1 >$w/cli.out 2>&1
kill -TERM $(pgrep -P $sp echo_server) 2>/dev/null; wait $sp
echo "rate $(awk -v s=$S '$1==s {print $5}' $w/cli.out)  load $(cut -d' ' -f1 /proc/loadavg)"
for f in srv cli; do
  awk -F, -v n=$N -v f=$f '/^[0-9]/{ split($3,a,":"); nm=(a[2]!="")?a[2]:$3; sub("sys_enter_","",nm); v=$1/n; if (nm=="task-clock") v=v*1000; printf "%s %s=%.3f ", f, nm, v } END{print ""}' $w/$f.perf
done
rm -rf $w
