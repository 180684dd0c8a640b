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

// TestFits: a run of determinants is cut where one Pack can hold it, at MaxBatch determinants or where a
// connection beyond MaxConns would be named, and what it keeps packs.
func TestFits(t *testing.T) {
	nth := func(i int) tcpflow.Tuple {
		return tcpflow.Tuple{Local: netip.MustParseAddrPort("10.0.0.2:5001"), Remote: netip.AddrPortFrom(netip.MustParseAddr("10.0.0.1"), uint16(1+i%60000))}
	}
	many := func(n, conns int) []Det {
		out := make([]Det, n)
		for i := range out {
			out[i] = Det{Conn: nth(i % conns), End: uint32(i + 1), Len: 1}
		}
		return out
	}
	for _, tc := range []struct {
		name string
		dets []Det
		want int
	}{
		{"none", nil, 0},
		{"few", many(10, 3), 10},
		{"one connection, more than a batch", many(MaxBatch+5, 1), MaxBatch},
		{"as many connections as a batch names", many(MaxConns, MaxConns), MaxConns},
		{"more connections than a batch names", many(MaxConns+5, MaxConns+5), MaxConns},
		{"connections named again after the bound", append(many(MaxConns, MaxConns), many(MaxConns+3, MaxConns+3)...), 2 * MaxConns},
	} {
		got := Fits(tc.dets)
		if got != tc.want {
			t.Errorf("%s: %d fit, want %d", tc.name, got, tc.want)
		}
		if _, err := Pack(tc.dets[:got]); err != nil {
			t.Errorf("%s: the %d that fit do not pack: %v", tc.name, got, err)
		}
	}
}
