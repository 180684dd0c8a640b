package ebpfprobes

import (
	"testing"

	"github.com/ftkit/ftkit/netlog/park"
)

// setPark accepts the buckets the program can tell apart (a power of 2 up to park.MaxBuckets, the
// program's & 0xff) and refuses the others before any constant is set.
func TestSetParkBuckets(t *testing.T) {
	for _, tc := range []struct {
		buckets int
		ok      bool
	}{
		{0, true}, {1, true}, {8, true}, {park.MaxBuckets, true},
		{-1, false}, {3, false}, {2 * park.MaxBuckets, false},
	} {
		spec, err := loadTcplog()
		if err != nil {
			t.Fatal(err)
		}
		err = setPark(spec, ParkOptions{Ifindex: 1, Queues: 2, Buckets: tc.buckets, MinLen: 4096, MaxLen: 65536}, 1<<20)
		if (err == nil) != tc.ok {
			t.Errorf("setPark with %d buckets: %v; want ok %v", tc.buckets, err, tc.ok)
		}
	}
}
