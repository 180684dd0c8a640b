package tcpflow

import (
	"encoding/json"
	"errors"
	"net/netip"
	"testing"
)

var (
	a = netip.MustParseAddrPort("10.0.0.1:40000")
	b = netip.MustParseAddrPort("10.0.0.2:5201")
)

func TestValidate(t *testing.T) {
	tests := []struct {
		name string
		t    Tuple
		ok   bool
	}{
		{"IPv4", Tuple{a, b}, true},
		{"IPv6", Tuple{netip.MustParseAddrPort("[fd00::1]:1"), netip.MustParseAddrPort("[fd00::2]:2")}, true},
		{"mapped and IPv4", Tuple{netip.MustParseAddrPort("[::ffff:10.0.0.1]:1"), b}, true},
		{"zero", Tuple{}, false},
		{"no remote", Tuple{Local: a}, false},
		{"unspecified local", Tuple{netip.MustParseAddrPort("0.0.0.0:1"), b}, false},
		{"port 0", Tuple{a, netip.MustParseAddrPort("10.0.0.2:0")}, false},
		{"link-local with zone", Tuple{netip.MustParseAddrPort("[fe80::1%eth0]:1"), netip.MustParseAddrPort("[fe80::2%eth0]:2")}, true},
		{"mixed families", Tuple{a, netip.MustParseAddrPort("[fd00::2]:2")}, false},
	}
	for _, tt := range tests {
		err := tt.t.Validate()
		if (err == nil) != tt.ok || tt.t.IsValid() != tt.ok {
			t.Errorf("%s: Validate(%v) = %v, want ok=%v", tt.name, tt.t, err, tt.ok)
		}
		if err != nil && !errors.Is(err, ErrInvalid) {
			t.Errorf("%s: error %v does not wrap ErrInvalid", tt.name, err)
		}
	}
}

func TestReverseUnmapString(t *testing.T) {
	tu := Tuple{Local: a, Remote: b}
	if got := tu.Reverse(); got != (Tuple{Local: b, Remote: a}) || got.Reverse() != tu {
		t.Errorf("Reverse(%v) = %v", tu, got)
	}
	if got, want := tu.String(), "10.0.0.1:40000->10.0.0.2:5201"; got != want {
		t.Errorf("String = %q, want %q", got, want)
	}
	mapped := Tuple{netip.MustParseAddrPort("[::ffff:10.0.0.1]:40000"), netip.MustParseAddrPort("[::ffff:10.0.0.2]:5201")}
	if mapped == tu || mapped.Unmap() != tu {
		t.Errorf("Unmap(%v) = %v, want %v", mapped, mapped.Unmap(), tu)
	}
}

// TestJSON pins the encoding: manifests and recovery records hold it.
func TestJSON(t *testing.T) {
	tu := Tuple{Local: a, Remote: b}
	j, err := json.Marshal(tu)
	if err != nil {
		t.Fatal(err)
	}
	if want := `{"local":"10.0.0.1:40000","remote":"10.0.0.2:5201"}`; string(j) != want {
		t.Errorf("JSON %s, want %s", j, want)
	}
	var back Tuple
	if err := json.Unmarshal(j, &back); err != nil || back != tu {
		t.Errorf("round trip: %v, %v", back, err)
	}
	type embedding struct {
		Tuple
		Inode uint64 `json:"inode"`
	}
	j, err = json.Marshal(embedding{tu, 7})
	if want := `{"local":"10.0.0.1:40000","remote":"10.0.0.2:5201","inode":7}`; err != nil || string(j) != want {
		t.Errorf("embedded JSON %s (%v), want %s", j, err, want)
	}
}

// FuzzDecode feeds untrusted JSON through the decoder and Validate: neither panics, and what Validate
// accepts re-encodes to a tuple that decodes the same.
func FuzzDecode(f *testing.F) {
	for _, s := range []string{
		`{"local":"10.0.0.1:40000","remote":"10.0.0.2:5201"}`,
		`{"local":"[fd00::1]:1","remote":"[fd00::2]:2"}`,
		`{"local":"","remote":"10.0.0.2:0"}`,
		`{"local":"[fe80::1%eth0]:1"}`,
		`{}`, `null`, `[1]`,
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		var tu Tuple
		if json.Unmarshal(data, &tu) != nil || tu.Validate() != nil {
			return
		}
		j, err := json.Marshal(tu)
		if err != nil {
			t.Fatalf("valid %v does not encode: %v", tu, err)
		}
		var back Tuple
		if err := json.Unmarshal(j, &back); err != nil || back != tu {
			t.Fatalf("%v re-decodes as %v (%v)", tu, back, err)
		}
	})
}
