package intercept

import (
	"errors"
	"net/netip"
	"reflect"
	"testing"

	"github.com/ftkit/ftkit/tcpflow"
)

func conn(local, remote string) tcpflow.Tuple {
	return tcpflow.Tuple{Local: netip.MustParseAddrPort(local), Remote: netip.MustParseAddrPort(remote)}
}

var (
	connA = conn("10.9.0.1:5000", "10.9.0.2:40000")
	connB = conn("10.9.0.1:5000", "10.9.0.3:40001")
)

func TestPackRoundTrip(t *testing.T) {
	for _, dets := range [][]Det{
		{},
		{{Conn: connA, End: 100, Len: 100}},
		{{Conn: connA, End: 100, Len: 100}, {Conn: connB, End: 7, Len: 7, Thread: 3, Proc: 2, Pos: 1 << 40}, {Conn: connA, End: 0xffffff00 + 300 - 1<<32, Len: 300, Thread: 1, Proc: 1, Pos: 9}},
	} {
		b, err := Pack(dets)
		if err != nil {
			t.Fatal(err)
		}
		got, err := Unpack(b)
		if err != nil {
			t.Fatal(err)
		}
		if len(dets) == 0 && len(got) == 0 {
			continue
		}
		if !reflect.DeepEqual(got, dets) {
			t.Fatalf("round trip: got %v, want %v", got, dets)
		}
	}
}

func TestPackRefuses(t *testing.T) {
	v6 := tcpflow.Tuple{Local: netip.MustParseAddrPort("[fd00::1]:1"), Remote: netip.MustParseAddrPort("[fd00::2]:2")}
	if _, err := Pack([]Det{{Conn: v6, End: 1, Len: 1}}); err == nil {
		t.Error("an IPv6 connection was packed")
	}
	if _, err := Pack(make([]Det, MaxBatch+1)); err == nil {
		t.Error("more than MaxBatch determinants were packed")
	}
}

func TestUnpackRefuses(t *testing.T) {
	good, err := Pack([]Det{{Conn: connA, End: 10, Len: 10}})
	if err != nil {
		t.Fatal(err)
	}
	badIndex := append([]byte(nil), good...)
	badIndex[len(badIndex)-detSize] = 0
	badIndex[len(badIndex)-detSize+1] = 1 // connection 1 of 1
	zeroPort := append([]byte(nil), good...)
	zeroPort[3+4], zeroPort[3+5] = 0, 0
	oldVersion := append([]byte(nil), good...)
	oldVersion[0] = 1
	for _, tc := range []struct {
		name string
		b    []byte
	}{
		{"empty", nil},
		{"truncated", good[:len(good)-1]},
		{"trailing", append(append([]byte(nil), good...), 0)},
		{"index out of table", badIndex},
		{"zero port", zeroPort},
		{"too many conns", []byte{packVersion, 0xff, 0xff}},
		{"too many dets", []byte{packVersion, 0, 0, 0xff, 0xff, 0xff, 0xff}},
		{"another version", oldVersion},
	} {
		if _, err := Unpack(tc.b); !errors.Is(err, ErrFormat) {
			t.Errorf("%s: %v, want ErrFormat", tc.name, err)
		}
	}
}

func FuzzUnpack(f *testing.F) {
	good, _ := Pack([]Det{{Conn: connA, End: 10, Len: 10}, {Conn: connB, End: 3, Len: 3}})
	f.Add(good)
	f.Add([]byte{packVersion, 0, 0, 0, 0, 0, 0})
	f.Fuzz(func(t *testing.T, b []byte) {
		dets, err := Unpack(b)
		if err != nil {
			return
		}
		again, err := Pack(dets)
		if err != nil {
			t.Fatalf("decoded determinants do not encode again: %v", err)
		}
		back, err := Unpack(again)
		if err != nil || len(back) != len(dets) {
			t.Fatalf("re-encoded determinants do not decode: %v", err)
		}
		for i := range dets {
			if back[i] != dets[i] {
				t.Fatalf("determinant %d: %v then %v", i, dets[i], back[i])
			}
		}
	})
}
