package image

import (
	"encoding/binary"
	"encoding/hex"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/checkpoint-restore/go-criu/v7/crit/images/inventory"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
)

// criuInventory is inventory.img as CRIU 4.2.1 wrote it on this machine kind
// for `criu dump --leave-running --network-lock nftables` of a sleep.
const criuInventory = "163131584e000000080210011a18080110011801200128013002380340044806500758086005200128013000580162006a24" +
	"37663035613163352d656235632d343031302d383739342d633762343435396136333533"

func encodeInventory(t testing.TB, e *inventory.InventoryEntry, extra []byte) []byte {
	t.Helper()
	payload := append(marshal(t, e), extra...)
	b := binary.LittleEndian.AppendUint32(nil, magicInventory)
	return appendEntry(b, payload)
}

func runIDField(id string) []byte {
	b := protowire.AppendTag(nil, fieldDumpRunID, protowire.BytesType)
	return protowire.AppendString(b, id)
}

func TestDecodeInventory(t *testing.T) {
	real, err := hex.DecodeString(criuInventory)
	if err != nil {
		t.Fatal(err)
	}
	nft := uint32(NetworkLockNFTables)
	// An unknown varint field (14, allow_uprobes) before the run id must be skipped.
	uprobes := protowire.AppendVarint(protowire.AppendTag(nil, 14, protowire.VarintType), 1)
	tests := []struct {
		name    string
		b       []byte
		want    Inventory
		wantErr string
	}{
		{name: "criu 4.2.1", b: real, want: Inventory{ImgVersion: 2, RunID: "7f05a1c5-eb5c-4010-8794-c7b4459a6353", NetworkLock: NetworkLockNFTables}},
		{name: "synthetic", b: encodeInventory(t, &inventory.InventoryEntry{ImgVersion: proto.Uint32(2), NetworkLockMethod: &nft, TcpClose: proto.Bool(true)},
			append(uprobes, runIDField("abc")...)),
			want: Inventory{ImgVersion: 2, RunID: "abc", NetworkLock: NetworkLockNFTables, TCPClose: true}},
		{name: "old criu: no run id, default lock", b: encodeInventory(t, &inventory.InventoryEntry{ImgVersion: proto.Uint32(2)}, nil),
			want: Inventory{ImgVersion: 2, NetworkLock: NetworkLockIPTables}},
		{name: "empty", b: nil, wantErr: "too short"},
		{name: "common magic first", b: appendEntry(appendHeader(nil, magicInventory), marshal(t, &inventory.InventoryEntry{ImgVersion: proto.Uint32(2)})), wantErr: "magic"},
		{name: "truncated", b: real[:len(real)-1], wantErr: "only"},
		{name: "trailing bytes", b: append(append([]byte(nil), real...), 0), wantErr: "after the inventory entry"},
		{name: "missing img_version", b: appendEntry(binary.LittleEndian.AppendUint32(nil, magicInventory), runIDField("x")), wantErr: "InventoryEntry"},
		{name: "run id too long", b: encodeInventory(t, &inventory.InventoryEntry{ImgVersion: proto.Uint32(2)}, runIDField(strings.Repeat("a", maxRunIDLen+1))), wantErr: "more than"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := decodeInventory("inventory.img", tt.b)
			if tt.wantErr != "" {
				if err == nil || !errors.Is(err, ErrFormat) || !strings.Contains(err.Error(), tt.wantErr) {
					t.Fatalf("error %v, want ErrFormat containing %q", err, tt.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if got != tt.want {
				t.Errorf("got %+v, want %+v", got, tt.want)
			}
		})
	}
}

func TestReadInventory(t *testing.T) {
	dir := t.TempDir()
	if _, err := ReadInventory(dir); err == nil || !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("missing inventory: %v", err)
	}
	real, _ := hex.DecodeString(criuInventory)
	if err := os.WriteFile(filepath.Join(dir, inventoryName), real, 0o600); err != nil {
		t.Fatal(err)
	}
	inv, err := ReadInventory(dir)
	if err != nil || inv.RunID != "7f05a1c5-eb5c-4010-8794-c7b4459a6353" || inv.NetworkLock.String() != "nftables" {
		t.Fatalf("ReadInventory = %+v, %v", inv, err)
	}
}

// FuzzDecodeInventory: arbitrary bytes never panic, and an accepted image's
// run id is bounded and comes from the bytes given.
func FuzzDecodeInventory(f *testing.F) {
	real, _ := hex.DecodeString(criuInventory)
	f.Add(real)
	f.Add(real[:20])
	f.Add(encodeInventory(f, &inventory.InventoryEntry{ImgVersion: proto.Uint32(1)}, runIDField("x")))
	f.Fuzz(func(t *testing.T, b []byte) {
		inv, err := decodeInventory("fuzz.img", b)
		if err != nil {
			if !errors.Is(err, ErrFormat) {
				t.Fatalf("error without ErrFormat: %v", err)
			}
			return
		}
		if len(inv.RunID) > maxRunIDLen || !strings.Contains(string(b), inv.RunID) {
			t.Fatalf("run id %q not bounded or not from the input", inv.RunID)
		}
	})
}
