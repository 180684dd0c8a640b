package clusterapi

import (
	"bufio"
	"bytes"
	"net/netip"
	"strings"
	"testing"
	"time"
)

// decodeWatermark decodes a peer's reply line as strictly as the client (which also bounds the reply).
func decodeWatermark(line []byte) (LogWatermark, error) {
	var r LogWatermark
	err := ReadLine(bufio.NewReader(bytes.NewReader(line)), &r, MaxMessage)
	return r, err
}

func TestLogWatermarkPlaced(t *testing.T) {
	sent := time.Date(2026, 5, 1, 12, 0, 0, 0, time.UTC)
	many := `"10.0.0.1"` + strings.Repeat(`,"10.0.0.1"`, MaxWatermarkAddrs)
	tests := []struct {
		name      string
		line      string
		wantAt    time.Time
		wantHeld  bool
		wantAddrs []netip.Addr
		wantErr   string
	}{
		{"idle node", `{"age_ns":0,"held":false,"addrs":["10.0.0.2","127.0.0.1"]}`, sent, false,
			[]netip.Addr{netip.MustParseAddr("10.0.0.2"), netip.MustParseAddr("127.0.0.1")}, ""},
		{"held 90 s back", `{"age_ns":90000000000,"held":true,"addrs":["10.0.0.2"]}`, sent.Add(-90 * time.Second), true,
			[]netip.Addr{netip.MustParseAddr("10.0.0.2")}, ""},
		{"IPv4-mapped address is unmapped", `{"age_ns":1,"addrs":["::ffff:10.0.0.2"]}`, sent.Add(-1), false,
			[]netip.Addr{netip.MustParseAddr("10.0.0.2")}, ""},
		{"no addresses: covers nothing", `{"age_ns":1}`, sent.Add(-1), false, []netip.Addr{}, ""},
		// "No watermark now" travels as a refusal (*Error), not as a field of the reply.
		{"an error field", `{"error":"a restore is in progress on node2"}`, time.Time{}, false, nil, "unknown field"},
		{"negative age", `{"age_ns":-1,"addrs":["10.0.0.2"]}`, time.Time{}, false, nil, "negative age"},
		{"empty address", `{"age_ns":1,"addrs":[""]}`, time.Time{}, false, nil, "invalid address"},
		{"too many addresses", `{"age_ns":1,"addrs":[` + many + `]}`, time.Time{}, false, nil, "more than"},
		{"not an address", `{"age_ns":1,"addrs":["node2"]}`, time.Time{}, false, nil, "ParseAddr"},
		{"age not a number", `{"age_ns":"1s"}`, time.Time{}, false, nil, "cannot unmarshal"},
		{"no newline", `{"age_ns":1}`, time.Time{}, false, nil, "EOF"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			line := tc.line + "\n"
			if tc.name == "no newline" {
				line = tc.line
			}
			r, err := decodeWatermark([]byte(line))
			var w struct {
				At    time.Time
				Held  bool
				Addrs []netip.Addr
			}
			if err == nil {
				pw, perr := r.Placed("node2", sent)
				err = perr
				w.At, w.Held, w.Addrs = pw.At, pw.Held, pw.Addrs
			}
			if tc.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
					t.Fatalf("got %+v, %v; want an error containing %q", w, err, tc.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if !w.At.Equal(tc.wantAt) || w.Held != tc.wantHeld || len(w.Addrs) != len(tc.wantAddrs) {
				t.Fatalf("got %+v, want at %v held %v addrs %v", w, tc.wantAt, tc.wantHeld, tc.wantAddrs)
			}
			for i := range w.Addrs {
				if w.Addrs[i] != tc.wantAddrs[i] {
					t.Fatalf("addrs %v, want %v", w.Addrs, tc.wantAddrs)
				}
			}
		})
	}
}

// FuzzLogWatermark feeds arbitrary reply lines to the decoder of another node's watermark: it must never
// panic, and what it accepts must never place the watermark after the question left nor list an address
// it cannot match.
func FuzzLogWatermark(f *testing.F) {
	for _, s := range []string{
		`{"age_ns":0,"held":false,"addrs":["10.0.0.2","127.0.0.1"]}` + "\n",
		`{"age_ns":90000000000,"held":true,"addrs":["::ffff:10.0.0.2","fd00::1"]}` + "\n",
		`{"error":"a restore is in progress"}` + "\n",
		`{"age_ns":-5}` + "\n",
		`{"age_ns":9223372036854775807,"addrs":[]}` + "\n",
		`{"addrs":[""]}` + "\n",
		"\n",
		`{"age_ns":1` + "\n",
	} {
		f.Add([]byte(s))
	}
	sent := time.Date(2026, 5, 1, 12, 0, 0, 0, time.UTC)
	f.Fuzz(func(t *testing.T, line []byte) {
		r, err := decodeWatermark(line)
		if err != nil {
			return
		}
		w, err := r.Placed("node2", sent)
		if err != nil {
			return
		}
		if w.At.After(sent) {
			t.Fatalf("watermark %v placed after the question left (%v): %q", w.At, sent, line)
		}
		if len(w.Addrs) > MaxWatermarkAddrs {
			t.Fatalf("%d addresses accepted", len(w.Addrs))
		}
		for _, a := range w.Addrs {
			if !a.IsValid() || a.Unmap() != a {
				t.Fatalf("address %v accepted as is", a)
			}
		}
	})
}
